"""``python -m mergepipe``: the same as the ``mergepipe`` command (a running `mergepipe serve` runs it)."""

from mergepipe.launch import main

main()

"""``python -m mergepipe``: the same as the ``mergepipe`` command."""

from mergepipe.cli import main

main()

"""`mergepipe push SNAPSHOT|DIR ORG/NAME`, and `--push-to-hub` for the commands that publish (`merge`,
`execute`, `mergepipe-yaml`): a snapshot onto the Hugging Face Hub as one commit (``app/publishing.py``).
Credentials are huggingface_hub's (``HF_TOKEN``, or `hf auth login`); the endpoint its ``HF_ENDPOINT``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mergepipe.app.publishing import HubTarget, Pushed, push
from mergepipe.cli.common import DB_OPTION, ConsoleReporter, echo
from mergepipe.errors import ConfigError
from mergepipe.sizes import format_bytes

_PRIVATE_HELP = "Create the repository private if it does not exist (an existing public one is refused)."
_REVISION_HELP = "Branch to commit to [default: main]; created from main if missing."


def push_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--push-to-hub ORG/NAME [--private] [--revision BRANCH]``: push the published snapshot too."""
    for option in reversed([
        click.option("--push-to-hub", "push_to_hub", default=None, metavar="ORG/NAME",
                     help="Then push the published snapshot to this Hugging Face Hub repository, as one commit of "
                     "every file (as `mergepipe push` does; credentials from HF_TOKEN or `hf auth login`). A failed "
                     "push leaves the snapshot published and prints the command that retries it."),
        click.option("--private", is_flag=True, help=f"With --push-to-hub. {_PRIVATE_HELP}"),
        click.option("--revision", default=None, metavar="BRANCH", help=f"With --push-to-hub. {_REVISION_HELP}"),
    ]):
        func = option(func)
    return func


def hub_target(kwargs: dict[str, Any]) -> HubTarget | None:
    """The Hub target the ``push_options`` ask for (None without ``--push-to-hub``); they are removed from
    ``kwargs``."""
    repo_id, private, revision = kwargs.pop("push_to_hub"), kwargs.pop("private"), kwargs.pop("revision")
    if repo_id is None:
        if private or revision is not None:
            raise ConfigError(f"{'--private' if private else '--revision'} needs --push-to-hub ORG/NAME")
        return None
    return HubTarget(repo_id=repo_id, private=private, revision=revision)


def print_pushed(pushed: Pushed) -> None:
    """Where the snapshot is on the Hub now."""
    hub = pushed.location
    where = f"branch {hub.revision}{', private' if hub.private else ''}"
    if not pushed.created:
        echo(f"snapshot {pushed.snapshot_id} of model '{pushed.model_id}' is on the Hub already: {hub.uri} "
             f"({where}; it holds these {len(pushed.files)} files, so no commit was made)")
        return
    removed = f"; removed {len(pushed.deleted)} file(s) the snapshot does not have" if pushed.deleted else ""
    echo(f"pushed snapshot {pushed.snapshot_id} of model '{pushed.model_id}' to {hub.uri} "
         f"({where}; {len(pushed.files)} files, {format_bytes(pushed.total_bytes)}{removed})")


@click.command("push")
@DB_OPTION
@click.argument("target", metavar="SNAPSHOT|DIR")
@click.argument("repo_id", metavar="ORG/NAME")
@click.option("--private", is_flag=True, help=_PRIVATE_HELP)
@click.option("--revision", default=None, metavar="BRANCH", help=_REVISION_HELP)
def push_cmd(db_path: Path, target: str, repo_id: str, private: bool, revision: str | None) -> None:
    """Push a published snapshot to a Hugging Face Hub repository as one commit.

    SNAPSHOT is a snapshot id (or a unique prefix), a merged model id (name@N), or a snapshot's
    directory. Its files are verified, then all of them (weights, manifest.json, the model card,
    mergepipe_config.yml, config and tokenizer files) are committed at once, replacing whatever else
    the branch held (.gitattributes stays); the commit is recorded as a location of the snapshot,
    hf://ORG/NAME@COMMIT (`mergepipe snapshots`, `lineage`). Credentials come from HF_TOKEN or
    `hf auth login` and are never stored. A push that fails makes no commit and leaves the local
    snapshot as it was; running it again retries it.
    """
    print_pushed(push(db_path, target, repo_id, private=private, revision=revision, reporter=ConsoleReporter()))


COMMANDS = [push_cmd]

"""`mergepipe serve`: keep the imports warm, so every `mergepipe` command starts in milliseconds."""

from __future__ import annotations

import gc
import time
from functools import partial
from pathlib import Path

import click

from mergepipe.cli.common import run_command_line
from mergepipe.cli.server import listen, serve, server_pid
from mergepipe.cli.server import stop as stop_server
from mergepipe.served import SERVER_ENV, socket_from_env

#: Seconds `serve --stop` waits for the server (and the commands it lets finish) to go.
STOP_SECONDS = 60.0


@click.command("serve")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False, path_type=Path),
              help=f"Where to listen [default: ${SERVER_ENV} if it names a path, else $XDG_RUNTIME_DIR/mergepipe.sock "
              "or /tmp/mergepipe-UID/serve.sock; `mergepipe` commands look there too].")
@click.option("--status", is_flag=True, help="Say whether a server listens at the socket (and its pid); start none.")
@click.option("--stop", is_flag=True, help="Stop the server listening at the socket (it lets running commands "
              "finish first) and wait for it to go.")
@click.pass_context
def serve_cmd(ctx: click.Context, socket_path: Path | None, status: bool, stop: bool) -> None:
    """Keep one process with torch and every command imported; `mergepipe` commands then run in it.

    A command costs about 1.5 s of start-up before its first read, most of it importing torch. While this
    runs (in the foreground: start it in its own terminal, under systemd, or with `&`), every `mergepipe`
    command of this user that looks at the same socket forks a child of it instead, with the caller's
    terminal, working directory and environment: the same output, exit status and Ctrl-C, a second and a
    half sooner. Set MERGEPIPE_SERVER=off to run a command without it. A server started before the
    installed code changed is refused by the commands (they say so and run by themselves): restart it.
    Linux only; stop it with Ctrl-C or `mergepipe serve --stop`.
    """
    path = socket_path or socket_from_env()[0]
    if path is None:
        raise click.UsageError(f"${SERVER_ENV} turns the server off; give --socket PATH to serve anyway")
    if status:
        pid = server_pid(path)
        click.echo(f"no server listens at {path}" if pid is None else f"a server listens at {path} (pid {pid})")
        return
    if stop:
        click.echo(f"stopped the server at {path} (pid {stop_server(path, STOP_SECONDS)})")
        return
    started = time.perf_counter()
    root = ctx.find_root().command
    assert isinstance(root, click.Group)
    for name in root.list_commands(ctx):  # imports every command's module, torch and the engine with them
        root.get_command(ctx, name)
    gc.freeze()  # what is loaded now stays shared with the children, untouched by their collections
    sock = listen(path)
    click.echo(f"serving on {path} (imports took {time.perf_counter() - started:.1f} s); "
               "`mergepipe` commands now run here. Ctrl-C or `mergepipe serve --stop` stops it.", err=True)
    serve(sock, path, partial(run_command_line, root), _log)


def _log(line: str) -> None:
    click.echo(f"{time.strftime('%H:%M:%S')} {line}", err=True)


COMMANDS = [serve_cmd]

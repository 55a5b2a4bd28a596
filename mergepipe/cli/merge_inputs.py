"""What `plan` and `merge` merge: flags and ``--config`` combined, model references resolved.

A config file is read before the catalog is opened (its ``mergepipe:``
section may set the catalog's block size). Flags win over the config's
``mergepipe:`` section, which wins over the defaults. A mergekit config names
the models and the method itself, so ``--base``/``--experts``/``--operator``/
``--weights`` are refused beside one rather than silently mixed in.

A directory given where a model is expected is registered on the fly. Its
catalog name is the checkpoint already registered from that very directory
if there is one, else the folder's name if that is free, else the folder's
name with a short hash of the whole path: two ``…/model`` folders never
collide, and the same directory always gets the same name.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click

from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.errors import ConfigError, UnknownModelError
from mergepipe.spec.merge_config import load_config
from mergepipe.spec.merge_request import MergeRequest
from mergepipe.storage.location import RemotePath, is_remote, location
from mergepipe.units import parse_size

#: Defaults of the choices a config's ``mergepipe:`` section may also make.
DEFAULTS = {"operator": "ties", "budget": "100%", "policy": "energy", "seed": 0}
#: Flag -> parameter name, for the parameter flags (they override the config's global values).
PARAM_FLAGS = {"density": "density", "lambda_": "lambda", "gamma": "gamma", "epsilon": "epsilon", "t": "t",
               "rescale": "rescale", "normalize": "normalize"}
#: Characters a folder name may have that a model id may not (ids: letters, digits and . _ : + -).
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:+-]+")


@dataclass(frozen=True)
class MergeInputs:
    """A merge request with every choice made: flags over config over defaults."""

    request: MergeRequest
    budget: str
    policy: str
    seed: int
    block_bytes: int | None
    model_id: str | None
    out_shard_bytes: int | None


def read_inputs(kwargs: dict[str, Any]) -> MergeInputs:
    """Combine the flags in ``kwargs`` with ``--config``; no catalog access."""
    config_path = kwargs.get("config_path")
    if config_path is None:
        request = MergeRequest(form="mergepipe")
    else:
        try:
            content = Path(config_path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{config_path}: cannot read the config ({exc.strerror})") from None
        request = load_config(content, str(config_path))
    request = _with_flags(request, kwargs, str(config_path))
    settings = request.settings

    def choice(name: str) -> Any:
        flag = kwargs.get(name)
        return flag if flag is not None else settings.get(name, DEFAULTS.get(name))

    block_bytes = settings.get("block_bytes")
    return MergeInputs(
        request=request,
        budget=str(choice("budget")),
        policy=choice("policy"),
        seed=choice("seed"),
        block_bytes=None if block_bytes is None else parse_size(block_bytes, "mergepipe.block_bytes"),
        model_id=kwargs["model_id"] if kwargs.get("model_id") is not None else settings.get("model_id"),
        out_shard_bytes=shard_bytes(choice("out_shard_size")),
    )


def shard_bytes(value: Any) -> int | None:
    """``--out-shard-size`` in bytes. A bare number or a ``B`` size under 1 MiB is refused: in mergekit
    ``5B`` means five billion bytes, here five bytes, and a shard per tensor is never what was meant."""
    if value is None:
        return None
    size = parse_size(value, "--out-shard-size")
    text = str(value).strip()
    number = text.rstrip("bB").strip()
    if size < 1 or (text.lower().lstrip("0123456789.").strip() in ("", "b") and size < 1 << 20):
        raise ConfigError(f"--out-shard-size {value!r} is {size} bytes; give a unit, e.g. {number}GB "
                          "(mergekit's B means billions of bytes)")
    return size


def _with_flags(request: MergeRequest, kwargs: dict[str, Any], source: str) -> MergeRequest:
    """The request with the models, operator, weights and parameters the flags give."""
    if request.form == "mergekit":
        given = [flag for flag, key in (("--base", "base"), ("--experts", "experts"), ("--operator", "operator"),
                                        ("--weights", "weights")) if kwargs.get(key)]
        if given:
            raise ConfigError(f"{source} is a mergekit config: it names the models and the method; drop "
                              f"{', '.join(given)}")
    elif not kwargs.get("base") or not kwargs.get("experts"):
        raise ConfigError("give --base and --experts (or a mergekit config with --config)")
    else:
        request = replace(request, base=kwargs["base"], experts=tuple(kwargs["experts"]),
                          operator=kwargs.get("operator") or DEFAULTS["operator"])
    params = dict(request.params)
    params.update({name: kwargs[flag] for flag, name in PARAM_FLAGS.items() if kwargs.get(flag) is not None})
    out_dtype = kwargs.get("out_dtype") or request.out_dtype
    return replace(request, params=params, out_dtype=out_dtype)


def print_notes(request: MergeRequest) -> None:
    """What the translation of a mergekit config changed or ignored, on stderr."""
    for note in request.notes:
        click.echo(f"note: {note}", err=True)


def registered_ref(catalog: Catalog, value: str) -> str | None:
    """The exact reference of the registered model ``value`` names, or None."""
    try:
        return catalog.models.exact_ref(catalog.models.resolve(value))
    except UnknownModelError:
        return None


def model_ref(catalog: Catalog, value: str, registered: list[str]) -> str:
    """A reference to the exact version a registered name (its latest version), ``name@N`` or id means,
    or to a directory registered on the fly (appended to ``registered``, so that a failed command can
    take it back). Not the stored id: version 1's id is also its family's name, which would mean the
    latest version when resolved again."""
    known = registered_ref(catalog, value)
    if known is not None:
        return known
    path = location(value) if is_remote(value) else Path(value).expanduser()
    if isinstance(path, RemotePath) or path.is_dir():  # a remote URI is registered from its headers too
        model_id = directory_name(catalog, path)
        new = not catalog.models.exists(model_id)
        record = register_model(catalog, model_id, path)  # a no-op when this directory is already that model
        if new:
            registered.append(model_id)
        return catalog.models.exact_ref(record)
    if "+" in value:
        raise ConfigError(f"'{value}' looks like mergekit's model+lora form: LoRA adapters as inputs are not "
                          "supported yet (merge the adapter into its model first)")
    if "/" in value and not path.exists():
        raise ConfigError(f"'{value}' is neither a registered model nor a checkpoint directory; MergePipe does not "
                          "download from the Hugging Face Hub: download it first and give the directory")
    raise catalog.models.unknown(value)


def directory_name(catalog: Catalog, path: Path | RemotePath) -> str:
    """The catalog name of checkpoint directory ``path`` (see the module docstring)."""
    resolved = path if isinstance(path, RemotePath) else path.resolve()
    known = catalog.models.registered_at(str(resolved))
    if known is not None:
        return known.name
    name = _ID_UNSAFE.sub("-", resolved.name).strip("-._") or "model"
    if catalog.models.latest(name) is None and not catalog.models.exists(name):
        return name
    return f"{name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"

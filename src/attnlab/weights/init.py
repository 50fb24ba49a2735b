"""``model.init_from``, resolved in this one place (``resolve_init_from``), its data artifacts
(``init_artifacts``) and its weights copied into the net (``load_init``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.core.errors import CheckpointError, ConfigError, first_line
from attnlab.core.run_paths import find_last, is_sharded
from attnlab.weights.checkpoint import check_fits, fit_heads, load_checkpoint, metadata, require_task
from attnlab.weights.pretrained import load_pretrained

log = logging.getLogger(__name__)


def is_run_checkpoint(spec: str) -> bool:
    """Whether ``model.init_from`` names one of our runs (a ``.ckpt``, a sharded folder, a task name)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path.suffix == ".ckpt" or is_sharded(path)
    return path.suffix == ".ckpt" or "/" not in spec


def resolve_pretrained(spec: str, log_dir: Path) -> Path:
    """A run's checkpoint file, or for a task's name its newest run's ``last.ckpt``."""
    path = Path(spec).expanduser()
    if path.is_file() or is_sharded(path):
        return path
    if "/" not in spec and not spec.endswith(".ckpt"):
        try:
            return find_last(log_dir, f"{spec}/runs/*/checkpoints/last.ckpt")
        except CheckpointError:
            raise CheckpointError(
                f"model.init_from={spec}: no run of that task under {log_dir} "
                "(pre-train first) and no such file"
            ) from None
    raise CheckpointError(f"model.init_from={spec}: no such file")


def run_artifacts(path: Path, tasks: tuple[str, ...] = ()) -> dict[str, Any]:
    """The tokenizer (not the classes) of the run at ``path``; a run of a task not in ``tasks`` is refused."""
    meta = metadata(load_checkpoint(path), path)
    if tasks:
        require_task(meta, path, tasks, f"model.init_from needs a {' or '.join(tasks)} run to start from")
    tokenizer = meta["artifacts"].get("tokenizer")  # a run without text records none, or None
    return {"tokenizer": tokenizer} if tokenizer else {}


def resolve_init_from(spec: str | Mapping[str, str], log_dir: Path) -> Path | dict[str, str]:
    """``model.init_from`` as a path: a run's checkpoint, another library's saved model, or a Hugging Face
    hub name downloaded when online; a mapping ``{part: spec}`` gives each part's."""
    if isinstance(spec, Mapping):
        return {str(part): str(resolve_init_from(str(source), log_dir)) for part, source in spec.items()}
    try:
        if is_run_checkpoint(spec):
            return resolve_pretrained(spec, log_dir)
        path = Path(spec).expanduser()
        if not path.exists():
            raise CheckpointError(f"model.init_from={spec}: no such file or directory")
        return path
    except CheckpointError as e:
        if spec.endswith(".ckpt") or Path(spec).expanduser().exists() or not is_hub_name(spec):
            raise
        return download_from_hub(spec, str(e))


def is_hub_name(spec: str) -> bool:
    """Whether ``spec`` could name a Hugging Face hub repository (``name`` or ``owner/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return not spec.startswith((".", "/", "~"))


def download_from_hub(repo_id: str, not_here: str) -> Path:
    """A hub repository's weights, config and tokenizer files (never a pickle or code), or one line."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=["*.safetensors", "*.json", "*.txt"])
    except Exception as e:  # offline, unknown repository, gated, network: all one line
        raise CheckpointError(
            f"{not_here}; and {repo_id!r} could not be fetched from the Hugging Face hub ({first_line(e)})"
        ) from e
    log.info("model.init_from=%s: the hub's files in %s", repo_id, folder)
    return Path(folder)


def init_artifacts(path: str | Mapping[str, str], target: str) -> dict[str, Any]:
    """The data artifacts (the tokenizer) of ``model.init_from``'s weights for the task ``target``: a run's,
    another library's folder's, or for ``{part: path}`` the part's that has one."""
    if isinstance(path, Mapping):
        return part_artifacts(path)
    if is_run_checkpoint(path):  # a run of the same task, or a text classifier's pre-training
        task = target.rsplit(".", 1)[-1]
        return run_artifacts(
            Path(path), ("MaskedLMTask", task) if task == "TextClassificationTask" else (task,)
        )
    from attnlab.data.text.tokenizers import import_tokenizer

    tokenizer = import_tokenizer(Path(path))
    if tokenizer is None:
        if not target.endswith(".ImageClassificationTask"):  # an image classifier has no text
            log.warning(
                "model.init_from=%s has no tokenizer files: the data fits a tokenizer of its own", path
            )
        return {}
    log.info("model.init_from=%s: its %s tokenizer (%d tokens)", path, tokenizer.kind, tokenizer.vocab_size)
    return {"tokenizer": tokenizer.to_json()}


def part_artifacts(paths: Mapping[str, str]) -> dict[str, Any]:
    """The tokenizer of the one part in ``{part: path}`` that has one; different ones are refused."""
    found: dict[str, dict[str, Any]] = {}
    for part, path in paths.items():
        artifacts = run_artifacts(Path(path)) if is_run_checkpoint(path) else init_artifacts(path, "")
        if artifacts:
            found[str(part)] = artifacts
            log.info("model.init_from.%s=%s: its tokenizer goes to the data", part, path)
    if len({str(a["tokenizer"]) for a in found.values()}) > 1:
        raise CheckpointError(
            f"model.init_from: the parts {', '.join(found)} come with different tokenizers; "
            "train them on the same text"
        )
    return next(iter(found.values()), {})


def load_init(net: nn.Module, spec: str | Mapping[str, str], log_dir: Path = Path("logs")) -> None:
    """Copy the weights ``spec`` names into ``net``: a run's net, its encoder or the part the net is
    (``part_prefix``), another library's (its converter), or per part; a head of another size starts fresh."""
    if isinstance(spec, Mapping):
        for part, source in spec.items():
            try:
                target = net.get_submodule(str(part))
            except AttributeError:
                names = ", ".join(name for name, _ in net.named_children())
                raise ConfigError(
                    f"model.init_from.{part}: the net has no such part (its parts: {names})"
                ) from None
            load_init(target, str(source), log_dir)
        return
    if not is_run_checkpoint(spec):  # resolved already: a hub name is a folder by now
        load_pretrained(net, spec)
        refuse_non_finite(net, spec)
        return
    path = resolve_pretrained(spec, log_dir)
    target, state = run_weights(net, path)
    check_fits(target, state, f"{path} (model.init_from)")
    target.load_state_dict(state)
    refuse_non_finite(target, path)
    log.info("%s weights loaded from %s", "all" if target is net else "encoder", path)


def run_weights(net: nn.Module, path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """What of the run at ``path`` goes into which module of ``net`` (itself or its encoder), heads fitted."""
    saved = load_checkpoint(path)["state_dict"]
    state = {k.removeprefix("net."): v for k, v in saved.items() if k.startswith("net.")}
    target = net
    if state.keys() != net.state_dict().keys() and isinstance(getattr(net, "encoder", None), nn.Module):
        state = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
        target = net.encoder
    elif prefix := part_prefix(state, net):
        log.info("model.init_from: the net is %s's %s (the rest of that net left out)", path, prefix[:-1])
        state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    resized, missing, headless = fit_heads(state, target.state_dict(), ("head",))
    if resized:
        log.info("model.init_from: %s differ in size from %s's: they start fresh", ", ".join(resized), path)
    if missing:
        log.info("model.init_from: %s has no %s: they start fresh", path, ", ".join(missing))
    if headless:
        log.info("model.init_from: %s of %s left out (the net has no head)", ", ".join(headless), path)
    return target, state


def refuse_non_finite(net: nn.Module, source: str | Path) -> None:
    """Weights with a NaN or an infinity (which would train on a NaN loss) refused, the first named."""
    for name, tensor in net.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"model.init_from={source}: {name} holds NaN or infinite values; these weights "
                "cannot be trained from"
            )


def part_prefix(state: Mapping[str, torch.Tensor], net: nn.Module) -> str:
    """The prefix (``image.``) under which a saved net holds all of ``net`` but its head, else ""."""
    body = [k for k in net.state_dict() if not k.startswith("head")]
    if not body or all(k in state for k in body):
        return ""
    for key in state:
        if key.endswith(f".{body[0]}"):
            prefix = key[: -len(body[0])]
            if all(prefix + k in state for k in body):
                return prefix
    return ""

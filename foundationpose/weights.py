"""Checkpoints: load the official weights, or write deterministic random ones in the same layout.

Official layout (spec 2.9)::

    <root>/2023-10-28-18-33-37/model_best.pth   refiner   + config.yml
    <root>/2024-01-11-20-02-45/model_best.pth   scorer    + config.yml

``model_best.pth`` holds either a state_dict or a dict with the state_dict under ``"model"``;
loading is strict (keys and shapes of spec 4.6). Random weights (tests, benchmarks, demos
without the official files) use the same layout and carry a ``random_weights`` entry in their
``config.yml``; with them the compute is real but **the poses are meaningless**.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import yaml
from torch import nn

from foundationpose.errors import WeightsError
from foundationpose.models import RefineNet, ScoreNetMultiPair, randomize_

__all__ = [
    "REFINER_RUN",
    "SCORER_RUN",
    "CHECKPOINT_NAME",
    "REFINER_CONFIG",
    "SCORER_CONFIG",
    "RANDOM_SCHEME",
    "load_refiner",
    "load_scorer",
    "write_random_weights",
    "write_weights",
    "ensure_weights",
    "is_random_weights",
    "default_random_weights_dir",
]

logger = logging.getLogger(__name__)

REFINER_RUN = "2023-10-28-18-33-37"
SCORER_RUN = "2024-01-11-20-02-45"
CHECKPOINT_NAME = "model_best.pth"
CONFIG_NAME = "config.yml"
RANDOM_SCHEME = "fp-random-v1"  # bump when randomize_ changes, so cached random weights are rewritten

# Inference-relevant config.yml keys of the official runs (spec 2.9), in file order.
REFINER_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "c_in": 6,
        "use_BN": True,
        "rot_rep": "axis_angle",
        "trans_rep": "tracknet",
        "normalize_xyz": True,
        "crop_ratio": 1.2,
        "input_resize": [160, 160],
        "rot_normalizer": 0.3490658503988659,
        "trans_normalizer": [0.019999999552965164, 0.019999999552965164, 0.05000000074505806],
        "use_normal": False,
        "n_view": 1,
        "zfar": "Infinity",
    }
)
SCORER_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "c_in": 6,
        "use_BN": True,
        "normalize_xyz": True,
        "crop_ratio": 1.1,
        "input_resize": [160, 160],
        "use_normal": False,
        "use_mask": False,
        "enable_amp": True,
        "train_num_pair": 5,
        "zfar": "Infinity",
    }
)

# Keys that must match when present: the architecture and the constants the pipeline hard-codes.
# (trans_normalizer is unused with normalize_xyz; zfar, enable_amp, train_num_pair do not matter.)
_CHECKED = {
    "refiner": (
        "c_in",
        "use_BN",
        "rot_rep",
        "trans_rep",
        "normalize_xyz",
        "crop_ratio",
        "input_resize",
        "rot_normalizer",
        "use_normal",
        "n_view",
        "use_mask",
    ),
    "scorer": ("c_in", "use_BN", "normalize_xyz", "crop_ratio", "input_resize", "use_normal", "use_mask"),
}
_DEFAULTS_WHEN_ABSENT = {"use_mask": False}  # spec 2.9: "use_mask absent -> false"


class _TolerantLoader(yaml.SafeLoader):
    """SafeLoader that reads python-specific tags (e.g. ``!!python/tuple``) as plain data."""


def _construct_plain(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_TolerantLoader.add_multi_constructor("tag:yaml.org,2002:python/", _construct_plain)


def default_random_weights_dir() -> Path:
    """Where ``ensure_weights(None)`` keeps random weights: ``~/.cache/foundationpose-deploy/random_weights``."""
    return Path.home() / ".cache" / "foundationpose-deploy" / "random_weights"


# ----------------------------------------------------------------------------------------------
# loading


def load_refiner(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", *, trust_file: bool = False
) -> RefineNet:
    """Load the refiner, in eval mode on ``device``.

    path: a weights root (holding ``2023-10-28-18-33-37/model_best.pth``), that run directory,
    or a ``.pth`` file (a state_dict, or a dict with it under ``"model"``). A ``config.yml``
    next to the checkpoint is checked against spec 2.9. Raises WeightsError.
    trust_file: a checkpoint that holds more than tensors (python objects a training script pickled)
        is read with full unpickling, which runs code from the file; without it such a file raises
        WeightsError saying so. Plain tensor checkpoints (the official ones) never need it.
    """
    return _load("refiner", RefineNet(), Path(path), device, trust_file)  # type: ignore[return-value]


def load_scorer(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", *, trust_file: bool = False
) -> ScoreNetMultiPair:
    """Load the scorer (run ``2024-01-11-20-02-45``); same rules as ``load_refiner``."""
    return _load("scorer", ScoreNetMultiPair(), Path(path), device, trust_file)  # type: ignore[return-value]


def _run_name(kind: str) -> str:
    return REFINER_RUN if kind == "refiner" else SCORER_RUN


def _resolve_checkpoint(kind: str, path: Path) -> Path:
    path = path.expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        candidates = (path / CHECKPOINT_NAME, path / _run_name(kind) / CHECKPOINT_NAME)
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise WeightsError(
            f"no {kind} checkpoint under {path}: looked for {candidates[0]} (run directory) and "
            f"{candidates[1]} (weights root)"
        )
    raise WeightsError(f"{kind} weights path does not exist: {path}")


def _load(kind: str, model: nn.Module, path: Path, device: str | torch.device, trust_file: bool = False) -> nn.Module:
    checkpoint = _resolve_checkpoint(kind, path)
    config_path = checkpoint.parent / CONFIG_NAME
    if config_path.is_file():
        _check_config(kind, _read_config(config_path), config_path)
    else:
        logger.info("%s: no %s next to %s; configuration not checked", kind, CONFIG_NAME, checkpoint)
    state = _read_state_dict(checkpoint, trust_file)
    _check_keys(kind, model, state, checkpoint)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # e.g. a tensor that cannot be copied (dtype)
        raise WeightsError(f"{kind} checkpoint {checkpoint} does not load: {exc}") from exc
    logger.info("loaded %s from %s", kind, checkpoint)
    return model.to(device).eval()


def _read_config(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as f:
            data = yaml.load(f, Loader=_TolerantLoader)
    except (OSError, yaml.YAMLError) as exc:
        raise WeightsError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a mapping of config keys; got {type(data).__name__}")
    return data


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, bool) or isinstance(got, bool):
        return got is expected or (isinstance(got, str) and got.lower() == str(expected).lower())
    if isinstance(expected, float):
        return isinstance(got, int | float) and math.isclose(float(got), expected, rel_tol=1e-6)
    if isinstance(expected, list):
        return (
            isinstance(got, list | tuple)
            and len(got) == len(expected)
            and all(_same(e, g) for e, g in zip(expected, got, strict=True))
        )
    return got == expected


def _check_config(kind: str, config: Mapping[str, Any], path: Path) -> None:
    """Raise WeightsError when a checked key differs from the official run's value (spec 2.9)."""
    reference = REFINER_CONFIG if kind == "refiner" else SCORER_CONFIG
    problems, unchecked = [], []
    for key in _CHECKED[kind]:
        expected = reference.get(key, _DEFAULTS_WHEN_ABSENT.get(key))
        if key not in config:
            if key not in _DEFAULTS_WHEN_ABSENT:
                unchecked.append(key)
            continue
        if not _same(expected, config[key]):
            problems.append(f"{key}: expected {expected!r}, got {config[key]!r}")
    if problems:
        raise WeightsError(
            f"{path} does not describe the {kind} this code implements (run {_run_name(kind)}): "
            + "; ".join(problems)
        )
    if unchecked:
        logger.warning("%s: keys absent, not checked: %s", path, ", ".join(unchecked))


def _read_state_dict(path: Path, trust_file: bool = False) -> dict[str, torch.Tensor]:
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            # Some training scripts store extra python objects next to the weights. Reading
            # them runs pickle code from the file: only on the caller's explicit word.
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            reason = next((ln for ln in lines if "Unsupported" in ln or "WeightsUnpickler" in ln), lines[0] if lines else "")
            with path.open("rb") as f:
                head = f.read(2)
            if not (head == b"PK" or head[:1] == b"\x80"):  # neither torch's zip format nor a pickle
                raise WeightsError(f"cannot read checkpoint {path}: not a PyTorch checkpoint file") from exc
            if not trust_file:
                raise WeightsError(
                    f"{path} is not a plain tensor checkpoint ({reason}). Loading it needs full unpickling, "
                    "which runs code from the file: if you trust the file, pass --trust-weights-file "
                    "(server: trust_weights_file = true in its --config file; Python: trust_weights_file=True), or "
                    "re-save it as a "
                    "plain state_dict: torch.save(torch.load(f, weights_only=False)['model'], 'model_best.pth')"
                ) from exc
            logger.warning("%s is not a plain tensor checkpoint (%s); loading it with full unpickling "
                           "(trusted by the caller)", path, reason)
            obj = torch.load(path, map_location="cpu", weights_only=False)
    except WeightsError:
        raise
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as exc:
        raise WeightsError(f"cannot read checkpoint {path}: {exc}") from exc
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping):
        raise WeightsError(f"{path}: expected a state_dict (a mapping of tensors); got {type(obj).__name__}")
    state = dict(obj)
    if state and all(isinstance(k, str) and k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}  # saved from DataParallel
    return state


def _listing(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... and {len(items) - limit} more" if len(items) > limit else "")


def _check_keys(kind: str, model: nn.Module, state: Mapping[str, Any], path: Path) -> None:
    """Strict key/shape comparison with a readable WeightsError (counts and a few names)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    misshaped = []
    for key, ref in expected.items():
        value = state.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            misshaped.append(f"{key} (not a tensor: {type(value).__name__})")
        elif value.shape != ref.shape:
            misshaped.append(f"{key} (checkpoint {list(value.shape)}, model {list(ref.shape)})")
    if not (missing or unexpected or misshaped):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {_listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {_listing(unexpected)}")
    if misshaped:
        parts.append(f"{len(misshaped)} mis-shaped key(s): {_listing(misshaped)}")
    raise WeightsError(
        f"{kind} checkpoint {path} does not match {type(model).__name__} "
        f"({len(expected)} keys): " + "; ".join(parts)  # the key layout of spec 4.6
    )


# ----------------------------------------------------------------------------------------------
# random weights


def _atomic_write(path: Path, write: Any) -> None:
    """Write through a temporary file in the same directory, then rename (readers never see halves)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _config_text(kind: str, header: str, extra: Mapping[str, Any]) -> str:
    reference = REFINER_CONFIG if kind == "refiner" else SCORER_CONFIG
    data = {**dict(reference), **dict(extra)}
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


def write_weights(
    root: str | os.PathLike[str],
    refiner: nn.Module,
    scorer: nn.Module,
    *,
    extra_config: Mapping[str, Any] | None = None,
    header: str = "",
) -> Path:
    """Write both networks' weights in the official layout; returns ``root``.

    Files: ``root/<run>/model_best.pth`` (``{"model": state_dict}``, float32 tensors on the CPU) and
    ``root/<run>/config.yml`` (the official run's inference keys, spec 2.9, plus ``extra_config``), written
    atomically. ``header`` (comment lines, each starting with ``#``) goes at the top of both config files.
    """
    root = Path(root).expanduser()
    for kind, model in (("refiner", refiner), ("scorer", scorer)):
        run_dir = root / _run_name(kind)
        state = {
            k: (v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()).clone().contiguous()
            for k, v in model.state_dict().items()
        }
        _atomic_write(run_dir / CHECKPOINT_NAME, lambda f, s=state: torch.save({"model": s}, f))
        text = _config_text(kind, header.replace("{kind}", kind), extra_config or {}).encode("utf-8")
        _atomic_write(run_dir / CONFIG_NAME, lambda f, t=text: f.write(t))
    return root


def write_random_weights(root: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write deterministic random weights for both networks in the official layout; returns ``root``.

    Files: ``root/<run>/model_best.pth`` (``{"model": state_dict}``) and ``root/<run>/config.yml``
    for both runs. Same seed -> identical tensors on any machine (CPU generator, see
    ``foundationpose.models.random_init``); runs on CPU, a few seconds.
    """
    refiner, scorer = RefineNet(), ScoreNetMultiPair()
    randomize_(refiner, seed=seed)
    randomize_(scorer, seed=seed)
    header = (
        f"# RANDOM weights for the FoundationPose {{kind}} (written by foundationpose.weights, seed {seed}).\n"
        "# Same architecture and compute as the official run; poses estimated with them are meaningless.\n"
    )
    write_weights(root, refiner, scorer, header=header,
                  extra_config={"random_weights": {"seed": int(seed), "scheme": RANDOM_SCHEME}})
    logger.info("wrote random weights (seed %d) to %s", seed, root)
    return Path(root).expanduser()


def _random_marker(run_dir: Path) -> dict[str, Any] | None:
    config_path = run_dir / CONFIG_NAME
    if not config_path.is_file():
        return None
    try:
        marker = _read_config(config_path).get("random_weights")
    except WeightsError:
        return None
    return marker if isinstance(marker, dict) else None


def is_random_weights(root: str | os.PathLike[str]) -> bool:
    """Whether either run under the weights root was written by ``write_random_weights``."""
    root = Path(root).expanduser()
    return any(_random_marker(root / run) is not None for run in (REFINER_RUN, SCORER_RUN))


def _warn_random(root: Path) -> None:
    logger.warning(
        "USING RANDOM WEIGHTS from %s: the official FoundationPose checkpoints were not given, so "
        "poses are meaningless (compute, memory and timing are real). Pass the official weights "
        "root for real results.",
        root,
    )


def ensure_weights(
    root: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> tuple[Path, bool]:
    """Return ``(weights_root, is_random)``.

    root given: it must hold both runs' ``model_best.pth`` (WeightsError otherwise); returned
    as is (``is_random`` tells whether it holds random weights). root None: random weights with
    ``seed`` in ``cache_dir`` (default ``default_random_weights_dir()``), reused when present
    with the same seed and scheme, written otherwise. Random weights log a loud WARNING.
    """
    if root is not None:
        root = Path(root).expanduser()
        if not root.is_dir():
            raise WeightsError(f"weights root does not exist or is not a directory: {root}")
        missing = [
            str(root / run / CHECKPOINT_NAME)
            for run in (REFINER_RUN, SCORER_RUN)
            if not (root / run / CHECKPOINT_NAME).is_file()
        ]
        if missing:
            raise WeightsError(f"weights root {root} lacks {', '.join(missing)} (official layout: <root>/<run>/model_best.pth)")
        is_random = is_random_weights(root)
        if is_random:
            _warn_random(root)
        return root, is_random
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_random_weights_dir()
    wanted = {"seed": int(seed), "scheme": RANDOM_SCHEME}
    reusable = all(
        (cache / run / CHECKPOINT_NAME).is_file() and _random_marker(cache / run) == wanted
        for run in (REFINER_RUN, SCORER_RUN)
    )
    if not reusable:
        write_random_weights(cache, seed=seed)
    else:
        logger.info("reusing random weights (seed %d) in %s", seed, cache)
    _warn_random(cache)
    return cache, True

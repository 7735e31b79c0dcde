"""Which published layout a folder holds, and the family's reader and writer for it.

One table says what each family reads and writes; ``model.checkpoint: DIR`` comes through
``load_release``, ``rlvla3 export`` through ``save_release``. The layout modules build the
policies; the policies know nothing of layouts.
"""

from __future__ import annotations

from typing import Any

FORMATS = {"pi0": ("transformers", "lerobot"), "pi05": ("lerobot",), "gr00t_n15": ("release",), "openvla_oft": ("release",)}
"""Export formats per family (the first is the family's default)."""


def detect(local_dir: str, family: str) -> str:
    """The layout of ``local_dir`` for ``family`` (an error naming what was expected otherwise)."""
    from workers.release import lerobot_pi, transformers_pi0

    if family in ("pi0", "pi05") and lerobot_pi.is_lerobot_pi(local_dir):
        return "lerobot"
    if family == "pi0" and transformers_pi0.is_transformers_pi0(local_dir):
        return "transformers"
    if family in ("gr00t_n15", "openvla_oft"):
        return "release"
    raise ValueError(f"{family}: {local_dir}/config.json is neither a LeRobot ({'type: ' + family}) nor a "
                     f"transformers pi0 (model_type: pi0) config; {family} loads {FORMATS.get(family)}")


def load_release(local_dir: str, family: str, spec: Any, overrides: dict[str, Any] | None = None,
                 tokenizer: str = "", base: str = "") -> Any:
    """The family's policy from a released (or exported) checkpoint folder; ``overrides`` are
    options that win over the folder's own; ``tokenizer`` is ``model.tokenizer`` (for releases
    that ship none: GR00T N1.5); ``base`` is ``model.base`` (the release a folder of OpenVLA-OFT
    adapters without weights was trained on)."""
    from workers.release.sources import has_weights, resolve

    overrides = dict(overrides or {})
    if family not in FORMATS:
        raise NotImplementedError(f"{family}: no checkpoint loader")
    if base and family != "openvla_oft":
        raise ValueError(f"{family}: model.base is for openvla_oft folders of peft adapters; {family} folds none")
    src = resolve(local_dir, base, family)
    needs = ("config.json",) if family == "gr00t_n15" and tokenizer else ("config.json", "tokenizer.json")
    missing = [n for n in needs if not src.has(n)]
    if not has_weights(src.weights):
        missing.append("model.safetensors (or an index with its shards)")
    if "config.json" in missing or len(missing) > 1:
        hint = " (GR00T N1.5 folders ship no tokenizer: set model.tokenizer: DIR)" if family == "gr00t_n15" and "tokenizer.json" in missing else ""
        raise FileNotFoundError(f"{family}: checkpoint dir {local_dir!r} is missing: {', '.join(missing)}{hint}")
    layout = detect(local_dir, family)
    if layout == "lerobot":
        from workers.release import lerobot_pi

        return lerobot_pi.load(local_dir, family, spec, overrides)
    if layout == "transformers":
        from workers.release import transformers_pi0

        return transformers_pi0.load(local_dir, spec, overrides)
    if family == "gr00t_n15":
        from workers.release import gr00t_n15

        return gr00t_n15.load(local_dir, spec, overrides, tokenizer)
    from workers.release import openvla_oft

    return openvla_oft.load(local_dir, spec, overrides, base)


def save_release(policy: Any, out_dir: str, fmt: str | None = None) -> None:
    """Write ``policy`` in ``fmt``, one of its family's ``FORMATS`` (default: the family's first)."""
    family = policy.family
    fmt = fmt or FORMATS.get(family, ("",))[0]
    if fmt not in FORMATS.get(family, ()):
        raise ValueError(f"{family} exports as {list(FORMATS.get(family, ()))}, not {fmt!r}")
    if fmt == "lerobot":
        from workers.release import lerobot_pi

        lerobot_pi.save(policy, out_dir)
    elif fmt == "transformers":
        from workers.release import transformers_pi0

        transformers_pi0.save(policy, out_dir)
    else:
        _release_module(family).save(policy, out_dir)


def _release_module(family: str) -> Any:
    """The module of a family that has one release layout of its own (GR00T N1.5, OpenVLA-OFT)."""
    if family == "gr00t_n15":
        from workers.release import gr00t_n15

        return gr00t_n15
    from workers.release import openvla_oft

    return openvla_oft

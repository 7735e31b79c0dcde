"""Which published layout a folder holds, and the family's reader and writer for it.

One table says what each family reads and writes; ``model.checkpoint: DIR`` and
``Policy.from_pretrained`` come through ``load_release``, ``rlvla3 export`` through ``save_release``.
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


def load_release(local_dir: str, family: str, spec: Any, overrides: dict[str, Any]) -> Any:
    """The family's policy from a released (or exported) checkpoint folder."""
    import os

    has = lambda name: os.path.isfile(os.path.join(local_dir, name))  # noqa: E731
    missing = [n for n in ("config.json", "tokenizer.json") if not has(n)]
    if not has("model.safetensors") and not (os.path.isdir(local_dir) and any(n.endswith(".safetensors.index.json") for n in os.listdir(local_dir))):
        missing.append("model.safetensors (or an index with its shards)")
    if "config.json" in missing or len(missing) > 1:
        raise FileNotFoundError(f"{family}: checkpoint dir {local_dir!r} is missing: {', '.join(missing)}")
    layout = detect(local_dir, family)
    if layout == "lerobot":
        from workers.release import lerobot_pi

        return lerobot_pi.load(local_dir, family, spec, overrides)
    if layout == "transformers":
        from workers.release import transformers_pi0

        return transformers_pi0.load(local_dir, spec, overrides)
    from workers.release import vla_release

    return vla_release.load(local_dir, family, spec, overrides)


def save_release(policy: Any, out_dir: str, fmt: str) -> None:
    """Write ``policy`` in ``fmt``, one of its family's ``FORMATS``."""
    family = policy.family
    if fmt not in FORMATS.get(family, ()):
        raise ValueError(f"{family} exports as {list(FORMATS.get(family, ()))}, not {fmt!r}")
    if fmt == "lerobot":
        from workers.release import lerobot_pi

        lerobot_pi.save(policy, out_dir)
    elif fmt == "transformers":
        from workers.release import transformers_pi0

        transformers_pi0.save(policy, out_dir)
    else:
        from workers.release import vla_release

        vla_release.save(policy, out_dir)

"""RoboCasa adapter: a clear error where it cannot run; a short episode where it can."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest

from workers.envs.base import make_env
from tests.jobs import robocasa_available
from workers.envs.robocasa import RoboCasaUnavailable

pytestmark = pytest.mark.sim


@pytest.mark.skipif(robocasa_available(), reason="robocasa is installed here")
def test_missing_robocasa_gives_install_steps() -> None:
    with pytest.raises(RoboCasaUnavailable) as err:
        make_env("robocasa", 1)
    msg = str(err.value)
    assert "own virtualenv" in msg and "robosuite>=1.5" in msg
    assert "pip install" in msg and "download_kitchen_assets" in msg


def test_module_imports_without_robocasa() -> None:
    import workers.envs.robocasa as rc

    assert rc.RoboCasaOptions().task == "PnPCounterToCab"
    assert importlib.util.find_spec("workers.envs.robocasa") is not None


@pytest.mark.skipif(not robocasa_available(), reason="robocasa + robosuite>=1.5 + kitchen assets not installed")
def test_robocasa_episode() -> None:
    env = make_env("robocasa", 1, options={"image_size": [64, 64], "max_episode_steps": 2})
    try:
        a = env.reset([0], [1])
        b = env.reset([0], [1])
        np.testing.assert_array_equal(a.state, b.state)
        assert a.images["robot0_eye_in_hand"].shape == (1, 64, 64, 3) and a.instruction[0]
        env.step([0], np.zeros((1, env.spec.action_dim), np.float32))
        res = env.step([0], np.zeros((1, env.spec.action_dim), np.float32))
        assert res.truncated[0] or res.terminated[0]
    finally:
        env.close()


RC_PYTHON = Path(__file__).resolve().parents[1] / ".venv-robocasa" / "bin" / "python"


@pytest.mark.skipif(not RC_PYTHON.exists(), reason="no .venv-robocasa (RLVLA3_ROBOCASA=1 bash scripts/bootstrap.sh makes it)")
def test_robocasa_venv_builds_a_kitchen_or_names_what_it_lacks() -> None:
    """The registry's RoboCasa code either steps a kitchen in its own venv or says exactly why not."""
    probe = subprocess.run([str(RC_PYTHON), "-m", "workers.envs.robocasa"], capture_output=True, text=True, timeout=300)
    out = probe.stdout + probe.stderr
    if probe.returncode != 0:
        assert "robocasa cannot build kitchens here" in out, out[-2000:]
        assert "load_model_on_init" in out or "asset packs missing" in out, out[-2000:]
        return
    step = ("from workers.envs.base import make_env; import numpy as np; "
            "e = make_env('robocasa', 1, options={'task': 'OpenDrawer', 'image_size': [64, 64], 'max_episode_steps': 2}); "
            "e.reset([0], [0]); e.step([0], np.zeros((1, e.spec.action_dim), np.float32)); print('stepped')")
    ran = subprocess.run([str(RC_PYTHON), "-c", step], capture_output=True, text=True, timeout=600)
    assert "stepped" in ran.stdout, (ran.stdout + ran.stderr)[-3000:]

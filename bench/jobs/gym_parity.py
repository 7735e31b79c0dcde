"""PPO parity with a reference PPO: rlvla3 on Gymnasium MuJoCo, sync and async, seeds declared.

Each (env, mode, seed) is a real ``rlvla3 run`` job of ``configs/gym_<env>_ppo.yaml`` (CleanRL's
ppo_continuous_action.py settings), differing only in ``run.mode`` and ``run.seed``. Its
trainer writes one line per update (``trainer_metrics.jsonl``): the env steps consumed, the
wall-clock second and the raw, unscaled returns of the episodes that ended in that batch. That is
the curve: raw episode return against env steps and against seconds (from the first update).

    python bench/jobs/gym_parity.py --quick                          # Hopper-v4, 1 seed, 10k steps per mode
    python bench/jobs/gym_parity.py --out /tmp/parity                # Hopper + HalfCheetah, seeds 0 1 2, 1M steps
    python bench/jobs/gym_parity.py --envs hopper --modes sync --seeds 0 --out /tmp/parity   # one run

Every declared run is reported: a run that has not finished shows as missing in the table.
Runs are resumable per seed: a finished run leaves ``result.json`` (its figures and curve) in its
folder and is not run again (``--fresh`` reruns); it needs nothing else, so the result files of a
table split over several machines can be gathered under one ``--out``. A declared run with no
result is run, unless ``--gather``: then nothing runs, and it is reported missing (so five async
seeds can be read against ten sync ones). Runs go one after the other, never at the same time.

Output: ``parity.md`` (the table, the reference figures beside it, the commands), one PNG per env
(curves per mode and seed, against env steps and against seconds), ``results.json``, and one JSON
object last: ``final_return[env][mode]`` = ``{"per_seed": {seed: mean of the last 10% of
episodes}, "mean": ...}``, ``steps_per_s[env][mode]`` (mean over seeds of the run's env steps
per second, from the first env step), ``agreement[env]``: async's mean return over seeds per
tenth of the env steps against sync's mean +- 2 standard errors, and the final means' ratio with
its 95% interval over seeds and how often an async that is sync lands within 10%
(``seed_bands.final_ratio``), and
``sync_target[env]``: sync's mean against the lower of CleanRL's published mean minus one std and,
given ``--here ENV=LOG`` (CleanRL's unmodified script run on this machine, one log per seed; its
code stays outside the project), those runs' mean minus one std.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import numpy as np

from rlvla3.harness import seed_bands
from rlvla3.harness.bench import OUT_DIR, emit_to, note, parse_bench_args, save_figure, subplots
from rlvla3.harness.gym_runs import ENVS, MODES, final_return, kept_result, run_one

ROOT = Path(__file__).resolve().parents[2]

REFERENCE = {  # CleanRL's benchmark table, ppo_continuous_action.py, 1M steps, 3 seeds: mean, std
    "hopper": (2382.86, 271.74),
    "halfcheetah": (1442.64, 46.03),
}
FINAL_TOLERANCE = 0.10
"""Item 4: async's final mean within this share of sync's."""
EPISODE_LINE = re.compile(r"^global_step=(\d+), episodic_return=\[?\s*([-+0-9.eE]+)", re.M)
"""An episode in the output of CleanRL's ppo_continuous_action.py (``--here``)."""


def reference_here(logs: list[str]) -> dict[str, list[dict[str, Any]]]:
    """``ENV=LOG`` -> per env, the runs of CleanRL's own script on this machine: its episode lines
    as a curve (one episode a point) and their final return by our rule."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for item in logs:
        env, _, path = item.partition("=")
        if env not in ENVS or not path:
            raise SystemExit(f"--here wants ENV=LOG with ENV one of {sorted(ENVS)}: {item!r}")
        eps = EPISODE_LINE.findall(Path(path).read_text())
        if not eps:
            raise SystemExit(f"--here {item}: no 'global_step=N, episodic_return=[R]' line in it")
        curve = {"steps": [int(a) for a, _ in eps], "returns": [float(b) for _, b in eps], "episodes": [1] * len(eps)}
        runs.setdefault(env, []).append({"log": path, "final_return": final_return(curve), "curve": curve})
    return runs


def sync_target(env: str, results: list[dict[str, Any]], here: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Item 4's sync target: the mean over seeds at least the lower of CleanRL's published mean
    minus one std and, with ``--here`` runs, their mean minus one std (numpy's std, as a table's)."""
    out: dict[str, Any] = {}
    lows = []
    if env in REFERENCE:
        out["published_lower"] = round(REFERENCE[env][0] - REFERENCE[env][1], 2)
        lows.append(out["published_lower"])
    if here:
        finals = [r["final_return"] for r in here]
        mean, std = float(np.mean(finals)), float(np.std(finals))
        out["here"] = {"per_run": finals, "mean": round(mean, 2), "std": round(std, 2), "logs": [r["log"] for r in here]}
        out["here_lower"] = round(mean - std, 2)
        lows.append(out["here_lower"])
    sync = [r["final_return"] for r in results if r["mode"] == "sync" and r["final_return"] is not None]
    out["threshold"] = min(lows) if lows else None
    out["sync_mean"] = mean_or_none(sync)
    out["met"] = None if not lows or len(sync) < len(seeds) else bool(out["sync_mean"] >= out["threshold"])
    return out


def tenth_means(curve: dict[str, list], steps: int) -> list[float | None]:
    """Episode-weighted mean return of each tenth of the env-step axis (the updates whose
    consumed steps fall in it): one point per tenth, ``None`` where no episode ended."""
    return seed_bands.tenth_means(curve["steps"], curve["returns"], steps, weights=curve["episodes"])


def agreement(results: list[dict[str, Any]], steps: int) -> dict[str, Any] | None:
    """Item 4's test of async against sync (``rlvla3/harness/seed_bands.py``), and the final
    means within 10%. ``None`` until both modes have at least two seeds."""
    by_mode = {m: [tenth_means(r["curve"], steps) for r in results if r["mode"] == m] for m in MODES}
    if min(len(v) for v in by_mode.values()) < 2:
        return None
    bands = seed_bands.band_points(by_mode["sync"], by_mode["async"])
    finals = {m: [r["final_return"] for r in results if r["mode"] == m and r["final_return"] is not None]
              for m in MODES}
    final = seed_bands.final_ratio(finals["sync"], finals["async"], FINAL_TOLERANCE) or {}
    return {**bands, "final_async_over_sync": final.get("ratio"), "final_within_10pct": final.get("within"),
            "final_ratio_95": final.get("interval_95"), "final_chance_if_equal": final.get("chance_within_if_equal")}


def mean_or_none(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(float(np.mean(vals)), 2) if vals else None


def plot(env: str, results: list[dict[str, Any]], here: list[dict[str, Any]], path: Path) -> None:
    fig, axes = subplots(1, 2, figsize=(11, 4))
    colours = {"sync": "tab:blue", "async": "tab:orange"}
    for k, r in enumerate(here):  # CleanRL's script on this machine: a point per episode, so smoothed more
        axes[0].plot(r["curve"]["steps"], smooth(r["curve"]["returns"], 50), color="black", alpha=0.5, lw=0.8,
                     label="CleanRL here" if k == 0 else None)
    counts = {m: sum(1 for r in results if r["mode"] == m and r["curve"]["steps"]) for m in colours}
    labelled = set()
    for r in results:
        c = r["curve"]
        if not c["steps"]:
            continue
        first = r["mode"] not in labelled  # one legend entry a mode: fifteen seeds a mode stay readable
        labelled.add(r["mode"])
        kw = dict(color=colours.get(r["mode"], "grey"), alpha=0.8, lw=1,
                  label=f"{r['mode']} ({counts.get(r['mode'], 0)} seeds)" if first else None)
        axes[0].plot(c["steps"], smooth(c["returns"]), **kw)
        axes[1].plot(c["seconds"], smooth(c["returns"]), **kw)
    if env in REFERENCE:
        m, s = REFERENCE[env]
        for ax in axes:
            ax.axhspan(m - s, m + s, color="grey", alpha=0.15, label="CleanRL 1M (mean ± std)")
    axes[0].set_xlabel("env steps")
    axes[1].set_xlabel("seconds from the first update")
    for ax in axes:
        ax.set_ylabel("raw episode return")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{ENVS[env]}: rlvla3 PPO, sync vs async")
    save_figure(fig, path, 110)


def smooth(ys: list[float], k: int = 5) -> np.ndarray:
    y = np.asarray(ys, float)
    if len(y) < k:
        return y
    return np.convolve(np.pad(y, (k - 1, 0), mode="edge"), np.ones(k) / k, mode="valid")


def table(results: list[dict[str, Any]], envs: list[str], modes: list[str], seeds: list[int], steps: int,
          targets: dict[str, dict[str, Any]]) -> str:
    lines = ["| env | mode | seeds | final return per seed | mean | CleanRL (published) | env steps/s |",
             "|---|---|---|---|---|---|---|"]
    for env in envs:
        for mode in modes:
            rs = {r["seed"]: r for r in results if r["env"] == env and r["mode"] == mode}
            per = ", ".join(f"{s}: {rs[s]['final_return']}" if s in rs and rs[s]["final_return"] is not None
                            else f"{s}: missing" for s in seeds)
            ref = "{:,.2f} ± {:,.2f}".format(*REFERENCE[env]) if env in REFERENCE else "-"
            sps = mean_or_none([rs[s].get("steps_per_s") for s in seeds if s in rs])
            lines.append(f"| {ENVS[env]} | {mode} | {len(rs)}/{len(seeds)} | {per} | "
                         f"{mean_or_none([rs[s]['final_return'] for s in seeds if s in rs])} | {ref} | {sps} |")
    for env in envs:
        t = targets[env]
        if "here" in t:
            lines.append(f"| {ENVS[env]} | CleanRL here | {len(t['here']['per_run'])} | "
                         f"{', '.join(map(str, t['here']['per_run']))} | {t['here']['mean']} ± {t['here']['std']} | | |")
    lines += ["", "Sync against item 4's threshold (the lower of the published and here mean minus one std):", ""]
    lines += [f"- {ENVS[env]}: sync mean {targets[env]['sync_mean']}, threshold {targets[env]['threshold']}, "
              f"met: {targets[env]['met']}" for env in envs]
    for env in envs:
        agree = agreement([r for r in results if r["env"] == env], steps)
        if agree is None:
            continue
        lines += ["", f"{ENVS[env]}, async against sync's mean ± 2 SE over seeds, per tenth of the env steps "
                      f"(all within: {agree['all_within']}; final async/sync {agree['final_async_over_sync']}, "
                      f"within {FINAL_TOLERANCE:.0%}: {agree['final_within_10pct']}, 95% over seeds "
                      f"{agree['final_ratio_95']}, within {FINAL_TOLERANCE:.0%} {agree['final_chance_if_equal']} of the "
                      f"time when async is sync, "
                      f"`seed_bands.final_ratio`; an async that is sync passes the band test "
                      f"{agree['chance_if_equal']} of the time, `seed_bands.chance_if_equal`):", "",
                  "| tenth | sync mean | ± 2 SE | async mean | within |", "|---|---|---|---|---|"]
        lines += [f"| {p['tenth']} | {p.get('sync', '-')} | {p.get('sync_2se', '-')} | {p.get('async', '-')} | "
                  f"{p['within']} |" for p in agree["points"]]
    lines += ["", "Commands:", ""] + [f"    {r['command']}" for r in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", nargs="+", default=["hopper", "halfcheetah"], choices=sorted(ENVS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="declared up front; every one is reported")
    ap.add_argument("--steps", type=int, default=1_000_000, help="env steps per run")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per run before it is stopped")
    ap.add_argument("--fresh", action="store_true", help="rerun runs that already left a result")
    ap.add_argument("--gather", action="store_true",
                    help="run nothing: report the results kept under --out, a declared run without one as missing")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config setting for every run, as `rlvla3 run --set` (repeatable; e.g. algo.trust_region=behaviour)")
    ap.add_argument("--here", action="append", default=[], metavar="ENV=LOG",
                    help="the output of one run of CleanRL's unmodified ppo_continuous_action.py on this machine "
                         "(repeat per seed): its final return sets item 4's second sync threshold")
    args = parse_bench_args(ap, "Hopper-v4, seed 0, 10k steps per mode", smoke_help="tiny run for CI (no learning value)",
                            out=f"{OUT_DIR}/gym_parity")
    if args.quick or args.smoke:
        args.envs, args.seeds = ["hopper"], [0]
        args.steps = 4096 if args.smoke else 10_240
    if args.gather and args.fresh:
        raise SystemExit("--gather reads kept results and --fresh reruns them: choose one")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    here = reference_here(args.here)

    results = []
    for env in args.envs:
        for seed in args.seeds:
            for mode in args.modes:  # alternating modes, one run at a time
                folder = out / env / mode / f"seed{seed}"
                if args.gather:
                    if (r := kept_result(folder, args.steps)) is None:
                        note(f"{ENVS[env]} {mode} seed={seed}: no result kept under {folder}")
                        continue
                else:
                    r = run_one(ROOT, env, mode, seed, args.steps, folder, args.timeout, args.fresh, tuple(args.overrides))
                note(f"{ENVS[env]} {mode} seed={seed}: final_return={r['final_return']} episodes={r['episodes']} "
                     f"steps/s={r['steps_per_s']} rc={r['rc']}")
                results.append(r)
    pngs = []
    for env in args.envs:
        png = out / f"{env}.png"
        plot(env, [r for r in results if r["env"] == env], here.get(env, []), png)
        pngs.append(str(png))
    targets = {env: sync_target(env, [r for r in results if r["env"] == env], here.get(env, []), args.seeds)
               for env in args.envs}
    (out / "parity.md").write_text(table(results, args.envs, args.modes, args.seeds, args.steps, targets))
    final: dict[str, Any] = {}
    speed: dict[str, Any] = {}
    for env in args.envs:
        for mode in args.modes:
            rs = [r for r in results if r["env"] == env and r["mode"] == mode]
            per = {str(r["seed"]): r["final_return"] for r in rs}
            final.setdefault(ENVS[env], {})[mode] = {"per_seed": per, "mean": mean_or_none(list(per.values()))}
            speed.setdefault(ENVS[env], {})[mode] = mean_or_none([r["steps_per_s"] for r in rs])
    agree = {ENVS[env]: agreement([r for r in results if r["env"] == env], args.steps) for env in args.envs}
    report = {"final_return": final, "steps_per_s": speed, "agreement": agree,
              "sync_target": {ENVS[env]: t for env, t in targets.items()}, "steps": args.steps, "seeds": args.seeds,
              "runs": [{k: v for k, v in r.items() if k != "curve"} for r in results],
              "png": pngs, "table": str(out / "parity.md"), "out": str(out)}
    emit_to(out, "results.json", report)


if __name__ == "__main__":
    main()

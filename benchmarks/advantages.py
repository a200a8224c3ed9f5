"""Benchmark of the masked advantage scans against the per-timestep loop, TorchRL and the bandwidth floor.

Prints ONE JSON object. For every device (CPU, and CUDA when present) and shape ``B x T`` (float32, random
lengths, an interior gap on every third row, verl's masked-token semantics):

- ``public``: what users call (``compute_gae(..., whiten=False)`` and ``whiten=True``,
  ``compute_reinforce_pp_advantage``, ``compute_remax_advantage``) against the kernel each one wraps, timed
  interleaved in one loop (medians), with ``public_over_kernel`` (the target is at most 1.3);
  ``its_kernels_ms`` times the kernels the estimator launches as it calls them (the whitening and the
  baseline are fused into the scan on Triton, so the whitening estimators launch a normalising kernel too),
  ``public_over_its_kernels`` the cost of its checks and its one host sync, and ``unfused_ms`` the former
  form (the checked scan followed by the whitening or the baseline in PyTorch ops). Each call is timed by device
  events around it, so a function that syncs inside pays for the host's return from the sync before the end event
  is queued, while one that only queues kernels does not: on CUDA ``its_kernels_synced_ms`` (and
  ``public_over_its_kernels_synced``) times its kernels followed by one stream sync, the sync the public
  function makes and any caller needs before reading a result on the host, so that both sides end alike;
- ``ours_ms``: the dispatched scans (``masked_gae_scan``, the fused ``masked_gae_returns_scan``,
  ``masked_discounted_return_scan``) and, per backend, the GAE scan alone;
- ``oracle_loop_ms``: the per-timestep reference loop (what verl runs), float32, same inputs;
- ``torchrl_vec_gae_ms``: TorchRL's ``vec_generalized_advantage_estimate`` on the same shape when TorchRL is
  importable (it has no masked-gap semantics: this is a speed reference only, with ``done`` at each row's end);
- ``floor_ms``: bytes the fused GAE must move (rewards, values, mask in; advantages, returns out = 17 B/token)
  over the copy bandwidth measured in this run, and ``floor_20B_ms`` with the issue's 20 B/token;
- ``max_abs_err``: against the float64 oracle on valid tokens.

Also, on each device, the group estimators of :mod:`ppo_core.advantages` at B = 65536 rows in
8192 groups. On CUDA a small sweep of Triton launch shapes is recorded under ``triton_sweep``.

On CPU the load average before and after the run is recorded (``load_avg``): CPU timings on a shared machine
are only comparable within one run.

Usage: ``python benchmarks/advantages.py [--device cpu|cuda|all] [--quick] [--public] [--out FILE]``
(``--public``: only the public functions against their kernels).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from benchmarks._timing import median_ms, sync
from ppo_core import advantages, kernels
from ppo_core.advantages._common import zero_outside
from ppo_core.kernels import chunked, dispatch, reference, triton_scan
from ppo_core.kernels.whiten import whiten_valid

CPU_SHAPES = [(256, 1024), (512, 4096)]
CUDA_SHAPES = [(256, 1024), (512, 4096), (1024, 8192)]
GAMMA, LAM = 0.99, 0.95
FUSED_BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 4


def _time_interleaved(
    fns: dict[str, Callable[[], object]], device: str, repeats: int
) -> dict[str, tuple[float, float]]:
    """``(median, min)`` wall time in ms of each of ``fns``, all run in every round (order rotated), so that load
    hits all alike; the minimum is the least disturbed run, a check on the medians of a shared machine."""
    for fn in fns.values():
        fn()
        fn()
    sync(device)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def _public_report(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, repeats: int) -> dict:
    """Each public estimator against the raw kernel it wraps (``kernel``), same inputs, interleaved."""
    baselines = torch.randn(r.shape[0], generator=torch.Generator().manual_seed(1)).to(r.device)
    pairs = {
        "compute_gae(whiten=False)": (
            lambda: advantages.compute_gae(r, v, m, gamma=GAMMA, lam=LAM, whiten=False),
            "masked_gae_returns_scan",
            lambda: kernels.masked_gae_returns_scan(r, v, m, GAMMA, LAM),
        ),
        "compute_gae(whiten=True)": (
            lambda: advantages.compute_gae(r, v, m, gamma=GAMMA, lam=LAM, whiten=True),
            "masked_gae_returns_scan",
            lambda: kernels.masked_gae_returns_scan(r, v, m, GAMMA, LAM),
        ),
        "compute_reinforce_pp_advantage": (
            lambda: advantages.compute_reinforce_pp_advantage(r, m, gamma=GAMMA),
            "masked_discounted_return_scan",
            lambda: kernels.masked_discounted_return_scan(r, m, GAMMA),
        ),
        "compute_remax_advantage": (
            lambda: advantages.compute_remax_advantage(r, baselines, m),
            "masked_discounted_return_scan(gamma=1)",
            lambda: kernels.masked_discounted_return_scan(r, m, 1.0),
        ),
    }
    checked = {  # the scans in the form the estimators call: zeros at masked positions, non-finite flag
        "masked_gae_returns_checked": lambda: kernels.masked_gae_returns_checked(r, v, m, GAMMA, LAM),
        "masked_discounted_return_checked": lambda: kernels.masked_discounted_return_checked(r, m, GAMMA),
    }
    # The kernels each estimator launches, as it calls them (whitening / baseline fused on Triton), without the
    # estimator's checks and its one host sync; and, for the record, the unfused form it had before (the checked
    # scan, then the whitening or the baseline in PyTorch ops).
    fused = {
        "compute_gae(whiten=False)": lambda: dispatch._gae_checked(r, v, m, GAMMA, LAM),
        "compute_gae(whiten=True)": lambda: dispatch._gae_checked(r, v, m, GAMMA, LAM, whiten=True),
        "compute_reinforce_pp_advantage": lambda: dispatch._return_advantages_checked(
            r, m, GAMMA, whiten=True
        ),
        "compute_remax_advantage": lambda: dispatch._return_advantages_checked(
            r, m, 1.0, baselines=baselines
        ),
    }
    unfused = {
        "compute_gae(whiten=True)": lambda: whiten_valid(
            kernels.masked_gae_returns_checked(r, v, m, GAMMA, LAM)[0], m
        ),
        "compute_reinforce_pp_advantage": lambda: whiten_valid(
            kernels.masked_discounted_return_checked(r, m, GAMMA)[0], m
        ),
        "compute_remax_advantage": lambda: zero_outside(
            kernels.masked_discounted_return_checked(r, m, 1.0)[0] - baselines.unsqueeze(-1), m
        ),
    }
    # Each estimator is timed in its own interleaved group (public, its kernels, the raw scan), so that the
    # allocation-heavy unfused forms, timed in a group of their own, do not disturb the ratios of the others.
    ms: dict[str, tuple[float, float]] = {}
    cuda = r.device.type == "cuda"
    for name, (public, _, kernel) in pairs.items():
        group = {name: public, f"fused:{name}": fused[name], f"raw:{name}": kernel}
        # its kernels and the one stream sync a caller needs before using a result on the host, as the public
        # function makes it: both sides then end alike (after the sync, the end event is recorded)
        if cuda:
            group[f"synced:{name}"] = lambda fn=fused[name]: (fn(), torch.cuda.current_stream().synchronize())
        ms.update(_time_interleaved(group, r.device.type, repeats))
    others = dict(checked) | {f"unfused:{name}": fn for name, fn in unfused.items()}
    ms.update(_time_interleaved(others, r.device.type, repeats))
    report: dict = {}
    for name, (_, kernel_name, _) in pairs.items():
        raw = ms[f"raw:{name}"]
        entry = {
            "public_ms": round(ms[name][0], 4),
            "kernel": kernel_name,
            "kernel_ms": round(raw[0], 4),
            "public_over_kernel": round(ms[name][0] / raw[0], 3),
            "public_over_kernel_of_minima": round(ms[name][1] / raw[1], 3),
            "its_kernels_ms": round(ms[f"fused:{name}"][0], 4),
            "public_over_its_kernels": round(ms[name][0] / ms[f"fused:{name}"][0], 3),
            "public_over_its_kernels_of_minima": round(ms[name][1] / ms[f"fused:{name}"][1], 3),
        }
        if cuda:
            synced = ms[f"synced:{name}"]
            entry["its_kernels_synced_ms"] = round(synced[0], 4)
            entry["public_over_its_kernels_synced"] = round(ms[name][0] / synced[0], 3)
            entry["public_over_its_kernels_synced_of_minima"] = round(ms[name][1] / synced[1], 3)
        if name in unfused:
            entry["unfused_ms"] = round(ms[f"unfused:{name}"][0], 4)
        report[name] = entry
    report["checked_kernels_ms"] = {name: round(ms[name][0], 4) for name in checked}
    return report


def _host_us(fn: Callable[[], object], device: str, calls: int = 2000) -> float:
    """Host time (us) of one call of ``fn``: the best of 5 loops of ``calls`` calls (on CUDA the calls only queue
    work, except for the syncs they make themselves)."""
    for _ in range(50):
        fn()
    sync(device)
    loops = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
        sync(device)
    return min(loops)


def _estimator_layer_us(device: str) -> dict:
    """Time (us) of each public estimator beyond the kernels it calls, on inputs so small (2 x 4 on the CPU, 8 x 64
    on CUDA) that the kernels cost little, so the difference is the estimator's own Python: argument checks and
    reading the flag (on CUDA with its one sync, so ``its_kernels_and_flag_read_us`` is given too).

    On CUDA also the host time of the pieces a call is made of: one launch of the checked GAE kernel through
    Triton's launcher (``triton_launch_us``) and through the compiled kernel Triton's launcher found
    (``compiled_kernel_launch_us``, the ``kernel[grid](...)`` form of Triton's fused-softmax tutorial: what a
    launcher of our own would cost), and one stream sync of an idle stream (``stream_sync_us``).
    """
    shape = (2, 4) if device == "cpu" else (8, 64)
    gen = torch.Generator().manual_seed(0)
    r, v = (torch.randn(*shape, generator=gen).to(device) for _ in range(2))
    b = torch.randn(shape[0], generator=gen).to(device)
    m = torch.ones(*shape, dtype=torch.bool, device=device)

    def gae_and_flag():
        *_, flags = dispatch._gae_checked(r, v, m, GAMMA, LAM)
        return dispatch.flags_set(flags, None)

    def remax_and_flag():
        *_, flags = dispatch._return_advantages_checked(r, m, 1.0, baselines=b)
        return dispatch.flags_set(flags, None)

    pairs = {
        "compute_gae": (
            lambda: advantages.compute_gae(r, v, m, gamma=GAMMA, lam=LAM, whiten=False),
            lambda: dispatch._gae_checked(r, v, m, GAMMA, LAM),
            gae_and_flag,
        ),
        "compute_remax_advantage": (
            lambda: advantages.compute_remax_advantage(r, b, m),
            lambda: dispatch._return_advantages_checked(r, m, 1.0, baselines=b),
            remax_and_flag,
        ),
    }
    report: dict = {"shape": list(shape)}
    for name, (public, kernels_only, with_flag) in pairs.items():
        if device == "cpu":  # median of 2000 single calls each (the benchmark's CPU timer), in us
            public_us, kernels_us = (
                1e3 * median_ms(fn, "cpu", repeats=2000, warmup=200) for fn in (public, kernels_only)
            )
            entry = {}
        else:
            public_us, kernels_us = _host_us(public, device), _host_us(kernels_only, device)
            entry = {"its_kernels_and_flag_read_us": round(_host_us(with_flag, device), 2)}
        report[name] = {
            "public_us": round(public_us, 2),
            "its_kernels_us": round(kernels_us, 2),
            "estimator_us": round(public_us - kernels_us, 2),
            **entry,
        }
    if device == "cuda" and triton_scan.is_available("cuda"):
        report.update(_launch_us(r, v, m))
    return report


def _launch_us(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> dict:
    """Host time (us) of one launch of the checked GAE kernel through Triton's launcher and through the compiled
    kernel it returns, and whether the second writes the same outputs (see :func:`_estimator_layer_us`)."""
    tl = triton_scan.tl
    batch, length = r.shape
    launch = triton_scan._default_launch(length)
    words = triton_scan.host_flag_words(r.device, batch)
    constexprs = {
        "WITH_RETURNS": True,
        "CHECKED": True,
        "STATS": False,
        "ACC": tl.float32,
        "BLOCK_B": launch.block_b,
        "BLOCK_T": launch.block_t,
    }
    grid = triton_scan._grid(batch, launch)

    def args(adv: torch.Tensor, ret: torch.Tensor) -> tuple:
        return (r, v, m.view(torch.uint8), adv, ret, words, adv, batch, length, GAMMA, GAMMA * LAM)

    adv, ret = torch.empty_like(r), torch.empty_like(r)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    compiled = triton_scan._gae_kernel[grid](*args(adv, ret), **constexprs, **options)
    report = {
        "triton_launch_us": round(
            _host_us(lambda: triton_scan._gae_kernel[grid](*args(adv, ret), **constexprs, **options), "cuda"),
            2,
        ),
        "stream_sync_us": round(_host_us(lambda: torch.cuda.current_stream().synchronize(), "cuda"), 2),
    }
    try:  # every parameter in order, the constexprs included, as the tutorial launches it
        direct = (grid[0], 1, 1)
        positional = args(adv, ret) + tuple(constexprs.values())
        report["compiled_kernel_launch_us"] = round(
            _host_us(lambda: compiled[direct](*positional), "cuda"), 2
        )
        adv2, ret2 = torch.empty_like(r), torch.empty_like(r)
        compiled[direct](*(args(adv2, ret2) + tuple(constexprs.values())))
        torch.cuda.synchronize()
        report["compiled_kernel_same_outputs"] = bool(torch.equal(adv, adv2) and torch.equal(ret, ret2))
    except Exception as error:  # an API this Triton version lacks: recorded, not fatal
        report["compiled_kernel_launch_error"] = repr(error)
    return report


def _copy_bandwidth_gbps(device: str) -> float:
    """Bytes read plus written per second by a device copy of a buffer far larger than the caches."""
    numel = (256 << 20) if device == "cuda" else (32 << 20)  # 1 GiB on CUDA, 128 MiB on CPU
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats=20 if device == "cuda" else 7)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def _case(batch: int, length: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(length // 8, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask[::3, length // 3 : length // 3 + length // 16] = False  # multi-turn observation gap
    return rewards.to(device), values.to(device), mask.to(device)


def _torchrl() -> Callable | None:
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
    except Exception:  # any import failure means "not available" for a benchmark
        return None
    return vec_generalized_advantage_estimate


def _torchrl_ms(fn: Callable, r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, repeats: int) -> float:
    device = r.device.type
    lengths = m.sum(dim=1)
    done = torch.zeros_like(m)
    done[torch.arange(m.shape[0], device=r.device), (lengths - 1).clamp(min=0)] = True
    state, reward, done = v[..., None], r[..., None], done[..., None]
    next_state = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)[..., None]
    return median_ms(lambda: fn(GAMMA, LAM, state, next_state, reward, done, done), device, repeats)


def _max_err(out: torch.Tensor, ref: torch.Tensor, where: torch.Tensor) -> float:
    diff = (out.double() - ref.double())[where]
    return float(diff.abs().max()) if diff.numel() else 0.0


def _oracles(
    r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, ...]:
    """float64 GAE and discounted return: the loop where affordable, else the chunked scan in float64."""
    affordable = r.device.type == "cpu" and r.numel() <= 512 * 4096
    r64, v64 = r.double(), v.double()
    if affordable:
        return reference.masked_gae_scan(r64, v64, m, gamma, lam), reference.masked_discounted_return_scan(
            r64, m, gamma
        )
    return chunked.gae_scan_chunked(r64, v64, m, gamma, lam), chunked.discounted_return_scan_chunked(
        r64, m, gamma
    )


def _errors(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> dict:
    errors = {}
    for gamma, lam in ((GAMMA, LAM), (1.0, 1.0)):
        adv_ref, ret_ref = _oracles(r, v, m, gamma, lam)
        adv, ret = kernels.masked_gae_returns_scan(r, v, m, gamma, lam)
        key = f"gamma={gamma},lam={lam}"
        errors[key] = {
            "gae": _max_err(adv, adv_ref, m),
            "returns": _max_err(ret, adv_ref + v.double(), m),
            "discounted_return": _max_err(kernels.masked_discounted_return_scan(r, m, gamma), ret_ref, m),
        }
    return errors


def _shape_report(
    batch: int, length: int, device: str, bandwidth: float, quick: bool, torchrl: Callable | None
) -> dict:
    r, v, m = _case(batch, length, device)
    repeats = 5 if device == "cpu" else 50
    public = _public_report(r, v, m, repeats=25 if device == "cpu" else 100)
    ours = {
        "gae": lambda: kernels.masked_gae_scan(r, v, m, GAMMA, LAM),
        "gae_and_returns": lambda: kernels.masked_gae_returns_scan(r, v, m, GAMMA, LAM),
        "discounted_return": lambda: kernels.masked_discounted_return_scan(r, m, GAMMA),
    }
    report: dict = {"public": public}
    report["ours_ms"] = {name: median_ms(fn, device, repeats) for name, fn in ours.items()}
    report["backends_gae_ms"] = {
        b: median_ms(lambda b=b: kernels.masked_gae_scan(r, v, m, GAMMA, LAM, backend=b), device, repeats)
        for b in kernels.available_backends(device)
        if b != "reference"
    }
    if not quick and (device == "cuda" or batch * length <= 512 * 4096):
        loop = lambda: reference.masked_gae_scan(r, v, m, GAMMA, LAM)  # noqa: E731
        report["oracle_loop_ms"] = median_ms(loop, device, repeats=3, warmup=1)
        report["speedup_vs_loop"] = report["oracle_loop_ms"] / report["ours_ms"]["gae"]
    if torchrl is not None:
        report["torchrl_vec_gae_ms"] = _torchrl_ms(torchrl, r, v, m, repeats)
        report["speedup_vs_torchrl"] = report["torchrl_vec_gae_ms"] / report["ours_ms"]["gae"]
    tokens = batch * length
    report["floor_ms"] = tokens * FUSED_BYTES_PER_TOKEN / (bandwidth * 1e9) * 1e3
    report["floor_20B_ms"] = tokens * 20 / (bandwidth * 1e9) * 1e3
    report["fused_over_floor"] = report["ours_ms"]["gae_and_returns"] / report["floor_ms"]
    if device == "cuda":
        try:
            report["fused_graph_replay_ms"] = _graph_ms(ours["gae_and_returns"], repeats)
            report["fused_graph_over_floor"] = report["fused_graph_replay_ms"] / report["floor_ms"]
            report["fused_kernel_launches"] = _kernel_launches(ours["gae_and_returns"])
        except Exception as err:  # profiling or graphs unavailable: keep the rest of the report
            report["graph_or_profiler_error"] = repr(err)[:200]
    report["max_abs_err"] = _errors(r, v, m)
    return report


def _triton_sweep(batch: int, length: int) -> list[dict]:
    """Launch shapes of the fused GAE kernel at one size (float32 and float64 accumulation), fastest first."""
    r, v, m = _case(batch, length, "cuda")
    shapes = ((1, 512, 4), (1, 1024, 4), (1, 1024, 8), (1, 2048, 8), (2, 512, 4), (2, 1024, 8), (4, 512, 8))
    rows = []
    for (bb, bt, warps), stages, fp64 in itertools.product(shapes, (2, 3, 4), (False, True)):
        launch = triton_scan.ScanLaunch(block_b=bb, block_t=bt, num_warps=warps, num_stages=stages)
        fn = lambda launch=launch, fp64=fp64: triton_scan.gae_scan_triton(  # noqa: E731
            r, v, m, GAMMA, LAM, with_returns=True, accumulate_fp64=fp64, launch=launch
        )
        try:
            ms = median_ms(fn, "cuda", repeats=30)
        except Exception as err:  # a launch shape the compiler rejects is a data point, not a crash
            rows.append({**launch.to_dict(), "fp64": fp64, "error": repr(err)[:200]})
            continue
        rows.append({**launch.to_dict(), "fp64": fp64, "ms": round(ms, 5)})
    rows.sort(key=lambda row: row.get("ms", float("inf")))
    best_fp64 = [row for row in rows if row["fp64"]][:3]
    default = triton_scan._default_launch(length)
    return [{"default": default.to_dict(), "shape": f"{batch}x{length}"}, *rows[:8], *best_fp64]


def _graph_ms(fn: Callable[[], object], repeats: int) -> float:
    """Device time of ``fn`` replayed as a CUDA graph (no host launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, "cuda", repeats)


def _kernel_launches(fn: Callable[[], object]) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _group_report(device: str) -> dict:
    batch, groups, length = 65536, 8192, 128
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(batch, generator=gen)
    mask = torch.arange(length)[None, :] < torch.randint(1, length + 1, (batch,), generator=gen)[:, None]
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), mask.sum(1) - 1] = scores
    index_tensor = torch.arange(groups).repeat_interleave(batch // groups)
    index_str = [f"uid-{i}" for i in index_tensor.tolist()]
    rewards, mask = rewards.to(device), mask.to(device)
    index_tensor = index_tensor.to(device)
    estimators = {
        "grpo": advantages.compute_grpo_advantage,
        "rloo": advantages.compute_rloo_advantage,
        "reinforce_pp_baseline": advantages.compute_reinforce_pp_baseline_advantage,
        "opo": advantages.compute_opo_advantage,
        "gpg": advantages.compute_gpg_advantage,
    }
    report: dict = {"shape": f"{batch}x{length}", "groups": groups, "ms": {}}
    for name, fn in estimators.items():
        try:
            report["ms"][name] = median_ms(lambda fn=fn: fn(rewards, mask, index_tensor), device, repeats=5)
        except Exception as err:
            report["ms"][name] = repr(err)[:200]
    try:
        report["ms"]["grpo_str_index"] = median_ms(
            lambda: advantages.compute_grpo_advantage(rewards, mask, index_str), device, repeats=3
        )
    except Exception as err:
        report["ms"]["grpo_str_index"] = repr(err)[:200]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="skip the slow reference loop")
    parser.add_argument("--sweep", action="store_true", help="sweep Triton launch shapes on CUDA")
    parser.add_argument(
        "--public", action="store_true", help="only the public estimators against the kernels they wrap"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()

    torchrl = _torchrl()
    result: dict = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "torchrl": None if torchrl is None else sys.modules["torchrl"].__version__,
        "dtype": "float32",
        "gamma": GAMMA,
        "lam": LAM,
    }
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            result["cuda"] = {"skipped": "no CUDA device"}
            continue
        if args.public:
            load = os.getloadavg() if device == "cpu" else None
            shapes = {}
            for batch, length in CUDA_SHAPES if device == "cuda" else CPU_SHAPES:
                r, v, m = _case(batch, length, device)
                shapes[f"{batch}x{length}"] = _public_report(r, v, m, repeats=25 if device == "cpu" else 100)
            result[device] = {
                "name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                "backends": kernels.available_backends(device),
                "public": shapes,
            }
            result[device]["estimator_layer_us"] = _estimator_layer_us(device)
            if load is not None:
                result[device]["load_avg"] = {"before": load, "after": os.getloadavg()}
            continue
        load = os.getloadavg() if device == "cpu" else None
        bandwidth = _copy_bandwidth_gbps(device)
        section: dict = {
            "name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "backends": kernels.available_backends(device),
            "copy_bandwidth_GBps": bandwidth,
            "shapes": {},
        }
        for batch, length in CUDA_SHAPES if device == "cuda" else CPU_SHAPES:
            section["shapes"][f"{batch}x{length}"] = _shape_report(
                batch, length, device, bandwidth, args.quick, torchrl
            )
        if device == "cuda" and triton_scan.is_available("cuda"):
            section["triton_default_launch"] = triton_scan._default_launch(CUDA_SHAPES[-1][1]).to_dict()
        if device == "cuda" and args.sweep and triton_scan.is_available("cuda"):
            section["triton_sweep"] = _triton_sweep(*CUDA_SHAPES[-1])
        section["group_estimators"] = _group_report(device)
        if load is not None:
            section["load_avg"] = {"before": load, "after": os.getloadavg()}
        result[device] = section
    names = [result[d]["name"] for d in devices if isinstance(result.get(d), dict) and "name" in result[d]]
    emit(result, args.out, device_name=" + ".join(names) or None)


if __name__ == "__main__":
    main()

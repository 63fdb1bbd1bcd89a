"""Persistent policy engine: loading a new round's checkpoint in place vs starting a new engine.

With ``scale.policy_engine=persistent`` the rollout and eval stages talk to one vLLM engine that
lives for the whole run (:mod:`pipeline.engines.host`); between rounds it loads the new checkpoint
with ``collective_rpc("reload_weights")`` instead of starting again. This measures, through the
same :class:`~pipeline.engines.host.RemoteEngine` a stage uses, both ways of getting an engine
that serves a new checkpoint (a copy of the model in a temporary directory, so the path differs):

- ``start``: the host's first request, which builds the vLLM engine (what every per-stage
  rollout and eval stage pays),
- ``reload``: the next request, for the other checkpoint, which reloads the weights in place and
  drops the prefix cache.

Seconds are measured by the client (what the stage waits for, tokenizer load included) and by
the host (the engine work alone). Prints one JSON line per model and one with the ratio.

    .venv/bin/python benchmarks/bench_engine_reload.py                     # 0.5B policy (configs/default.yaml)
    .venv/bin/python benchmarks/bench_engine_reload.py --config configs/tiny.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--repeats", type=int, default=1, help="reloads timed (best of N, alternating checkpoints)")
    a = ap.parse_args()

    from pipeline.config import load_config
    from pipeline.engines.host import RemoteEngine, policy_engine_session
    from pipeline.stages.base import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="capo-reload-bench-"))
    try:
        cfg = load_config(a.config, [f"runs_dir={tmp / 'runs'}", "scale.policy_engine=persistent"])
        model = resolve_model(cfg.rollout.policy, cfg)
        copy = tmp / "checkpoint-copy"
        shutil.copytree(model, copy)
        with policy_engine_session(cfg):
            t0 = time.perf_counter()
            e = RemoteEngine(model, cfg.rollout.engine)
            start_client, start_host = time.perf_counter() - t0, e.stats.extra["load_seconds"]
            assert e.stats.extra["host_action"] == "started"
            e.close()
            reloads = []
            for i in range(a.repeats):
                target = str(copy) if i % 2 == 0 else model
                t0 = time.perf_counter()
                e = RemoteEngine(target, cfg.rollout.engine)
                reloads.append((time.perf_counter() - t0, e.stats.extra["load_seconds"]))
                assert e.stats.extra["host_action"] == "reloaded", e.stats.extra
                e.close()
        reload_client, reload_host = min(reloads)
        from pipeline.precision import bench_context, resolve_dtype

        env = {**bench_context(), "machine": platform.machine(), "cpus": os.cpu_count(), "model": Path(model).name,
               "dtype": resolve_dtype(cfg.rollout.engine.dtype).value, "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}
        print(json.dumps({"bench": "engine_reload", "way": "start", "client_seconds": round(start_client, 2),
                          "host_seconds": round(start_host, 2), **env}), flush=True)
        print(json.dumps({"bench": "engine_reload", "way": "reload", "client_seconds": round(reload_client, 2),
                          "host_seconds": round(reload_host, 2), "repeats": a.repeats, **env}), flush=True)
        print(json.dumps({"bench": "engine_reload", "start_over_reload_client": round(start_client / reload_client, 1),
                          "saved_seconds_per_engine_start": round(start_client - reload_client, 1), **env}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

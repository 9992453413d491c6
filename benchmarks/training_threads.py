"""How torch's thread count meets a busy machine: seconds per training step of a recipe (by default `make demo`'s,
quickstart-cpu) with 1 thread and with every core, while 0, 1, ... other processes keep a core busy each.

    python benchmarks/training_threads.py [RECIPE] [--model FOLDER] [--steps 3] [--busy 0,1]
                                          [--out benchmarks/results/training-threads.json]

One process builds the run as `attnres finetune` does (FinetuneRecipe: the model, LoRA, the data, the optimizer;
nothing is written) and times real training steps, the thread counts interleaved step by step so that a change
in the machine's other load hits both alike. The competing work is a plain Python busy loop per process (a job
that holds one core). The first step of each count is a warm-up and not counted. Other jobs already on the
machine add to the load asked for: the load average at the start and the end is recorded. Nothing here is a
pass/fail test: it prints and records numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="quickstart-cpu")
    parser.add_argument("--model", help="model.source override (e.g. the folder `attnres convert` wrote)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per thread count and busy level")
    parser.add_argument("--busy", default="0,1", help="numbers of competing busy processes, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from attnres_convert.finetune.recipe import load_recipe
    from attnres_convert.finetune.stopping import GracefulStop
    from attnres_convert.finetune.training import FinetuneRecipe
    from attnres_convert.io.threads import usable_cores

    overrides = [f"model.source={args.model}"] if args.model else []
    recipe = load_recipe(args.recipe, overrides + ["output.dir=/nonexistent/training-threads", "train.steps=100000"])
    run = FinetuneRecipe(recipe)
    run.distributed = run.accelerator.distributed_type.value
    run._build()  # model, LoRA, data, optimizer: what a step needs (no run folder)
    run._stop = GracefulStop()  # never entered: no signal handling, nothing requested
    cores = usable_cores()
    counts = sorted({1, cores})
    load_start = os.getloadavg()
    rows = []
    for busy in [int(b) for b in args.busy.split(",")]:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(1.0)
            times: dict[int, list[float]] = {n: [] for n in counts}
            for round_ in range(args.steps + 1):
                for n in counts if round_ % 2 == 0 else counts[::-1]:
                    torch.set_num_threads(n)
                    seconds = run.train_step().seconds
                    if round_:  # the first round warms up
                        times[n].append(seconds)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        row = {
            "busy_processes": busy,
            **{f"threads_{n}_s_per_step": statistics.median(times[n]) for n in counts},
            "runs": {str(n): times[n] for n in counts},
        }
        rows.append(row)
        print(
            f"{busy} busy: " + ", ".join(f"{n} thread(s) {statistics.median(times[n]):.2f} s/step" for n in counts),
            flush=True,
        )
    result = {
        "command": "python benchmarks/training_threads.py " + " ".join(sys.argv[1:]),
        "recipe": args.recipe,
        "model": args.model,
        "tokens_per_step": run.global_batch * recipe.data.seq_len,
        "cpu": cpu_name(),
        "cores": cores,
        "torch": torch.__version__,
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

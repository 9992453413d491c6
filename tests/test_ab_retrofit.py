"""`attnres ab --retrofit-after`: the baseline pretrained from scratch once per seed and saved at each N, the
paired retrofit A/B from each save on the text after step N, the from-scratch lead at the same tokens; the
report's numbers recomputed from the runs' logs; bad input refused before anything trains."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path

import pytest
import yaml
from finetune_helpers import tiny_model_folder, tiny_recipe, write_corpus, write_recipe
from tiny_models import CONFIGS
from typer.testing import CliRunner

from attnres_convert.cli import app
from attnres_convert.finetune.ab import arm_recipe, compute_equivalent, difference_se, folder_name, paired
from attnres_convert.finetune.evaluation import ratio_se
from attnres_convert.finetune.metrics import read_metrics
from attnres_convert.finetune.recipe import RecipeError
from attnres_convert.finetune.retrofit import (
    ARMS,
    ATTNRES,
    BASELINE,
    continued_is_current,
    plan_study,
    run_retrofit,
    savings_claim,
    study_plan,
)
from attnres_convert.finetune.study import plan_summary

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
SCRATCH = {"from_scratch": True, "tokenizer": "bytes", "layers": 4, "hidden": 32, "heads": 4, "kv_heads": 2}
STEPS, CONTINUED = 6, 2  # the pretraining schedule reaches the largest N (4) + the continued steps


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrofit")
    config = root / "llama-config"
    config.mkdir()
    CONFIGS["llama"]().save_pretrained(config)  # training from scratch reads the config alone
    corpus = write_corpus(root / "corpus")
    recipe = tiny_recipe(
        config,
        corpus,
        root / "unused",
        model=SCRATCH,
        train={"trainable": "full", "steps": STEPS, "lr": 3e-3, "warmup_steps": 1},
        retrofit={"steps": CONTINUED, "lr": 2e-3, "warmup_steps": 0},
        eval={"every": 2, "max_sequences": 4},
    )
    return {"root": root, "corpus": corpus, "recipe": write_recipe(root / "retrofit.yaml", recipe)}


def _records(folder):
    return read_metrics(folder / "metrics.jsonl")


def _evals(folder) -> dict[int, dict]:
    return {r["step"]: r for r in _records(folder) if r["kind"] == "eval"}


def _train(folder) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(folder) if r["kind"] == "train"}


@pytest.mark.slow  # 2 seeds x (pretraining + AttnRes from scratch + 2 N x 2 continued arms): twelve short trainings
def test_retrofit_study_end_to_end(setup, tmp_path):
    out, work = tmp_path / "study", tmp_path / "study-runs"
    result = runner.invoke(
        app, ["ab", str(setup["recipe"]), "--retrofit-after", "4,2", "--from-scratch", "--seeds", "2", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "after-2",
        "after-4",
        "from-scratch",
        "retrofit.json",
        "retrofit.md",
        "retrofit.png",
    ]
    for sub in ("after-2", "after-4", "from-scratch"):
        assert sorted(p.name for p in (out / sub).iterdir()) == ["ab.json", "ab.md", "ab.png"]
    report = json.loads((out / "retrofit.json").read_text())
    assert report["seeds"] == [0, 1] and report["pretraining_steps"] == STEPS and report["continued_steps"] == CONTINUED
    assert [p["after"] for p in report["after"]] == [2, 4]

    # The pretraining ran once per seed: one run folder each, every step logged once, a save at each N.
    scratch = work / "scratch"
    pretraining = {seed: scratch / folder_name(BASELINE, seed) for seed in (0, 1)}
    assert sorted(p.parent.name + "/" + p.name for p in scratch.glob("*/seed-*")) == [
        "attnres/seed-0",
        "attnres/seed-1",
        "baseline/seed-0",
        "baseline/seed-1",
    ]
    for seed, folder in pretraining.items():
        assert sorted(_train(folder)) == list(range(1, STEPS + 1))
        assert sorted(p.name for p in (folder / "snapshots").iterdir()) == ["step-2", "step-4"]

    per_step = 2 * 2 * 32  # micro_batch x grad_accum x seq_len
    for point in report["after"]:
        n = point["after"]
        runs = {
            (arm.name, seed): work / f"after-{n}" / folder_name(arm, seed)
            for arm in (BASELINE, ATTNRES)
            for seed in (0, 1)
        }
        for (arm, seed), folder in runs.items():
            # Every continued arm starts from that seed's save after N steps, on the training text after step N.
            saved = yaml.safe_load((folder / "recipe.yaml").read_text())
            assert saved["model"]["source"] == str(pretraining[seed] / "snapshots" / f"step-{n}")
            assert (
                saved["data"]["start_step"] == n
                and saved["train"]["steps"] == CONTINUED
                and saved["train"]["lr"] == 2e-3
            )
            # The save is the pretrained model at step N: the same held-out loss (the AttnRes arm: converted, exact)...
            assert _evals(folder)[0]["loss"] == pytest.approx(_evals(pretraining[seed])[n]["loss"], abs=1e-5)
            # ...and the continued baseline's first batch is the pretraining's batch N + 1, met by the same model.
            if arm == "baseline":
                assert _train(folder)[1] == pytest.approx(_train(pretraining[seed])[n + 1], abs=1e-5)
        # The leads, recomputed from the logged losses (baseline - AttnRes, same seed).
        finals = {key: _evals(folder)[CONTINUED]["loss"] for key, folder in runs.items()}
        leads = [finals["baseline", s] - finals["attnres", s] for s in (0, 1)]
        assert point["lead_final"]["per_seed"] == pytest.approx(leads)
        assert point["lead_final"]["mean"] == pytest.approx(sum(leads) / 2)
        for step, lead in point["lead_curve"]:
            expected = [
                _evals(runs["baseline", s])[step]["loss"] - _evals(runs["attnres", s])[step]["loss"] for s in (0, 1)
            ]
            assert lead["per_seed"] == pytest.approx(expected)
        assert [step for step, _ in point["lead_curve"]] == [0, 2]
        assert point["lead_curve"][0][1]["mean"] == pytest.approx(0, abs=1e-5)  # converted exactly at the save
        # The evaluation's standard error of the mean lead: paired over the held-out sequences, by hand.
        per_seed = []
        for s in (0, 1):
            base, arm = _evals(runs["baseline", s])[CONTINUED], _evals(runs["attnres", s])[CONTINUED]
            assert base["sequence_predictions"] == arm["sequence_predictions"]
            diffs = [a - b for a, b in zip(arm["sequence_losses"], base["sequence_losses"])]
            per_seed.append(ratio_se(diffs, base["sequence_predictions"]))
            assert 0 < per_seed[-1] < math.hypot(base["loss_se"], arm["loss_se"])  # pairing removes shared noise
        assert point["eval_se"] == pytest.approx(math.sqrt(sum(e * e for e in per_seed)) / 2)
        assert point["eval_se_paired"] is True
        assert point["verdict"] == savings_claim(paired(leads), point["eval_se"])
        # The token equivalent both ways, from the mean continued curves.
        mean = {
            arm: [(step, sum(_evals(runs[arm, s])[step]["loss"] for s in (0, 1)) / 2) for step in (0, 2)]
            for arm in ("baseline", "attnres")
        }
        figure = compute_equivalent(
            mean["baseline"], mean["attnres"][-1][1], CONTINUED * per_step, CONTINUED, mean["attnres"]
        )
        for key in ("ratio", "baseline_tokens", "ratio_at_baseline_final", "arm_tokens_to_baseline_final"):
            assert point["token_equivalent"][key] == (
                pytest.approx(figure[key]) if figure[key] is not None else None
            ), key
        # The from-scratch lead at the same tokens: step N + continued of the from-scratch runs.
        at = n + CONTINUED
        scratch_leads = [
            _evals(pretraining[s])[at]["loss"] - _evals(scratch / folder_name(ATTNRES, s))[at]["loss"] for s in (0, 1)
        ]
        assert point["scratch"]["step"] == at and point["scratch"]["tokens"] == at * per_step
        assert point["scratch"]["lead"]["per_seed"] == pytest.approx(scratch_leads)

    table = (out / "retrofit.md").read_text()
    first = report["after"][0]
    assert (
        f"| 2 | {first['baseline_at_start']:.4f} | {first['lead_final']['mean']:+.4f} ± {first['lead_final']['std']:.4f}"
        in table
    )
    assert f"{first['scratch']['lead']['mean']:+.4f}" in table and "(step 4)" in table
    assert (out / "retrofit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Again with --reuse: every run is read back (none trains), the same report.
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("metrics.jsonl")}
    assert len(stamps) == 12
    again = run_retrofit(
        setup["recipe"],
        after=[2, 4],
        seeds=2,
        from_scratch=True,
        output=out,
        reuse=True,
        overwrite=True,
        command=report["command"],
    )
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads(json.dumps(again.report))["after"] == report["after"]

    # A lever (--sweep) added later: only its continued runs train, paired with the same continued baselines.
    lever = "train.attnres_first_steps=1"
    result = runner.invoke(
        app,
        ["ab", str(setup["recipe"]), "--retrofit-after", "2,4", "--from-scratch", "--seeds", "2", "--reuse"]
        + ["--sweep", lever, "-o", str(out), "--overwrite"],
    )
    assert result.exit_code == 0, result.output
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    swept = json.loads((out / "retrofit.json").read_text())
    assert swept["sweep"] == [[lever]]
    for point in swept["after"]:
        arm_work = work / f"after-{point['after']}"
        (entry,) = point["levers"]
        assert entry["arm"] == f"attnres {lever}"
        finals = {
            name: [_evals(arm_work / name / f"seed-{seed}")[CONTINUED]["loss"] for seed in (0, 1)]
            for name in ("baseline", f"attnres__{lever.replace('=', '_')}")
        }
        leads = [b - a for b, a in zip(*finals.values())]
        assert entry["lead_final"]["per_seed"] == pytest.approx(leads)
        assert point["lead_final"] == next(p for p in report["after"] if p["after"] == point["after"])["lead_final"]
    assert f"| 4 | attnres {lever} |" in (out / "retrofit.md").read_text()
    # A save written again (the pretraining ran again) makes the runs continued from it stale, and only those.
    study = plan_study(setup["recipe"], ["model.from_scratch=true"], [2, 4], 2, True, work)
    current = {
        (n, arm.name, seed): continued_is_current(
            arm_recipe(study.data, study.continued_overrides(seed, n), arm, seed, study.after_work(n)),
            study.snapshot(seed, n),
        )
        for n in (2, 4)
        for arm in (BASELINE, ATTNRES)
        for seed in (0, 1)
    }
    assert all(current.values())
    saved = study.snapshot(1, 4) / "config.json"
    os.utime(saved, ns=(saved.stat().st_atime_ns, time.time_ns() + 10**9))
    stale = [
        key
        for key in current
        if not continued_is_current(
            arm_recipe(
                study.data,
                study.continued_overrides(key[2], key[0]),
                ARMS[key[1] == "attnres"],
                key[2],
                study.after_work(key[0]),
            ),
            study.snapshot(key[2], key[0]),
        )
    ]
    assert stale == [(4, "baseline", 1), (4, "attnres", 1)]
    # --reuse trains those two again (finished, but from the earlier save) and keeps every other run.
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("metrics.jsonl")}
    run_retrofit(setup["recipe"], after=[2, 4], seeds=2, from_scratch=True, output=out, reuse=True, overwrite=True)
    trained = sorted(str(p.parent.relative_to(work)) for p in stamps if p.stat().st_mtime_ns != stamps[p])
    assert trained == ["after-4/attnres/seed-1", "after-4/baseline/seed-1"], trained
    # The pretraining runs' recipe leaves the retrofit section out: changing it retrains no pretraining.
    assert yaml.safe_load((pretraining[0] / "recipe.yaml").read_text())["retrofit"]["steps"] is None


def test_a_lever_on_the_retrofit_section_reaches_the_continued_runs(setup, tmp_path):
    """The continued recipe copies the retrofit section into train: a --sweep arm's retrofit.X is its train.X, and
    retrofit.steps, shared by every arm, is refused in an arm."""
    study = plan_study(
        setup["recipe"], [], [2], 1, False, tmp_path, [["retrofit.attnres_lr=0.5"], ["train.kl_weight=0.1"]]
    )
    (lever, other) = study.levers
    assert lever.name == "attnres retrofit.attnres_lr=0.5" and lever.overrides == ("train.attnres_lr=0.5",)
    assert other.overrides == ("train.kl_weight=0.1",)
    recipe = arm_recipe(study.data, study.continued_overrides(0, 2), lever, 0, study.after_work(2))
    plain = arm_recipe(study.data, study.continued_overrides(0, 2), ATTNRES, 0, study.after_work(2))
    assert recipe.train.attnres_lr == 0.5 and plain.train.attnres_lr != 0.5
    with pytest.raises(RecipeError, match="--sweep: retrofit.steps is the same for every arm of the study"):
        plan_study(setup["recipe"], [], [2], 1, False, tmp_path, [["retrofit.steps=3"]])


def test_reuse_extends_the_continued_runs_to_more_retrofit_steps(setup, tmp_path):
    """The study again with a larger retrofit.steps (retrofit.schedule constant) continues every continued run
    from its checkpoint instead of training it again, and keeps the pretraining: the same leads as a study
    continued that long from the start."""
    common = ["retrofit.schedule=constant", "checkpoint.every=1"]
    whole = run_retrofit(setup["recipe"], [*common, "retrofit.steps=4"], after=[2], output=tmp_path / "whole")
    work = tmp_path / "runs"
    run_retrofit(setup["recipe"], common, after=[2], output=tmp_path / "short", workdir=work)
    continued = {arm: work / "after-2" / arm / "seed-0" for arm in ("baseline", "attnres")}
    shorter = {arm: (folder / "metrics.jsonl").read_text().splitlines() for arm, folder in continued.items()}
    pretraining = work / "scratch" / "baseline" / "seed-0" / "final_metrics.json"
    stamp = pretraining.stat().st_mtime_ns
    # The cost beforehand (benchmarks/retrofit_cost.py --workdir) counts what --reuse trains: no pretraining, and
    # each continued run from its checkpoint at step 1 (steps 2-4, evaluations at 2 and 4).
    spec = importlib.util.spec_from_file_location("retrofit_cost", ROOT / "benchmarks" / "retrofit_cost.py")
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    study = plan_study(setup["recipe"], [*common, "retrofit.steps=4"], [2], 1, False, work)
    assert {label: counts for label, _, counts in cost.count_runs(study, reuse=True)} == {
        "pretraining (baseline from scratch)": (0, 1, 0, 0),
        "baseline continued": (1, 1, 3, 2),
        "attnres continued": (1, 1, 3, 2),
    }
    assert [counts for _, _, counts in cost.count_runs(study, reuse=False)] == [
        (1, 1, 6, 4),
        *[(1, 1, 4, 3)] * 2,
    ]
    # ... and so does the study as it starts.
    assert (
        plan_summary([(r.train.steps, start) for _, r, start in study_plan(study, reuse=True)])
        == "3 runs: 1 kept, 2 resumed or extended; 6 training steps to go"
    )
    assert (
        plan_summary([(r.train.steps, start) for _, r, start in study_plan(study, reuse=False)])
        == "3 runs: 3 from step 0; 14 training steps to go"
    )
    longer = run_retrofit(
        setup["recipe"], [*common, "retrofit.steps=4"], after=[2], output=tmp_path / "long", workdir=work, reuse=True
    )
    assert pretraining.stat().st_mtime_ns == stamp
    (ours,), (theirs,) = longer.report["after"], whole.report["after"]
    assert [step for step, _ in ours["lead_curve"]] == [step for step, _ in theirs["lead_curve"]] == [0, 2, 4]
    for (_, lead), (_, reference) in zip(ours["lead_curve"], theirs["lead_curve"]):
        assert lead["per_seed"] == pytest.approx(reference["per_seed"], abs=1e-6)
    for arm, lines in shorter.items():
        now = (continued[arm] / "metrics.jsonl").read_text().splitlines()
        kept = [line for line in lines if json.loads(line)["step"] <= 1]  # up to its checkpoint at step 1
        assert now[: len(kept)] == kept and json.loads(now[-1])["step"] == 4


def test_savings_claim_follows_the_noise_rule():
    assert savings_claim(paired([0.05]), 0.001) == {"claim": False, "why": "one seed"}
    spread = savings_claim(paired([0.01, 0.03, -0.01]), 0.001)
    assert not spread["claim"] and spread["why"].startswith("|Δ| 0.0100 <= the seeds' spread 0.02")
    assert savings_claim(paired([0.010, 0.011, 0.012]), 0.02) == {
        "claim": False,
        "why": "|Δ| 0.0110 <= the evaluation's standard error 0.0200",
    }
    assert savings_claim(paired([0.010, 0.011, 0.012]), 0.002) == {"claim": True, "why": "AttnRes ahead"}
    assert savings_claim(paired([-0.010, -0.011, -0.012]), None) == {"claim": True, "why": "AttnRes behind"}
    # Runs that recorded no per-sequence losses: two independent errors of 0.03 and 0.04 at each of two seeds,
    # sqrt(2 x 0.05^2) / 2.
    old = ({"loss_se": 0.03}, {"loss_se": 0.04})
    assert difference_se([old, old]) == (pytest.approx(0.05 / 2**0.5), False)
    assert difference_se([({"loss_se": 0.03}, None)]) == (None, False)
    # The same sequences in both runs: the per-sequence differences' ratio estimator. Here the second run is the
    # first with every sequence 0.5 nats lower in sum: a constant shift per prediction has no spread.
    counts = [10, 20, 30]
    first = {"loss_se": 0.3, "sequence_losses": [30.0, 50.0, 95.0], "sequence_predictions": counts}
    shifted = {"loss_se": 0.3, "sequence_losses": [29.0, 48.0, 92.0], "sequence_predictions": counts}
    assert difference_se([(first, shifted)]) == (pytest.approx(0.0, abs=1e-12), True)
    noisy = {"loss_se": 0.3, "sequence_losses": [29.0, 49.0, 92.0], "sequence_predictions": counts}
    diffs = [1.0, 1.0, 3.0]
    mean = sum(diffs) / 60
    expected = math.sqrt(3 / 2 * sum((d - mean * c) ** 2 for d, c in zip(diffs, counts))) / 60
    assert difference_se([(first, noisy)]) == (pytest.approx(expected), True)
    # Different held-out sequences (another eval set): back to the independent errors.
    other = {**noisy, "sequence_predictions": [10, 20, 31]}
    assert difference_se([(first, other)]) == (pytest.approx(math.hypot(0.3, 0.3)), False)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            ["--retrofit-after", "2,7"],
            "--retrofit-after: 7 pretraining steps is past the recipe's schedule (train.steps = 6); set train.steps=7",
        ),
        (["--retrofit-after", "2,x"], "--retrofit-after: 'x' is not a positive whole number of pretraining steps"),
        (
            ["--retrofit-after", "5", "--from-scratch"],
            "train.steps: the from-scratch arms give the same-token lead at N + retrofit.steps = 7 "
            "steps, past train.steps = 6; set train.steps=7",
        ),
        (
            ["--retrofit-after", "2,3", "--from-scratch"],
            "eval.every: the from-scratch arms are compared with the retrofit at steps 5 "
            "(N + retrofit.steps), which eval.every = 2 does not evaluate",
        ),
        (
            ["--retrofit-after", "2", "train.trainable=lora"],
            "model.from_scratch: these fields belong to a retrofit of a pretrained model, "
            "not to training from scratch: train.trainable (lora;",
        ),
        (["--retrofit-after", "2", "retrofit.steps=null"], "retrofit.steps: required by --retrofit-after"),
        (
            ["--retrofit-after", "2", "data.train.files=null", "data.train.dataset=some/dataset"],
            "data.max_tokens: --retrofit-after on a dataset needs data.max_tokens set",
        ),
        (
            ["--retrofit-after", "2", "retrofit.warmup_steps=2"],
            "retrofit: warmup_steps (2) must be smaller than steps (2)",
        ),
        (
            ["--retrofit-after", "2", "retrofit.warmup_steps=null", "train.warmup_steps=3"],
            "retrofit: the continued phase after 2 steps (the recipe's train fields, retrofit's in their place): arm 'baseline': "
            "train: warmup_steps (3) must be smaller than steps (2)",
        ),
        (["--retrofit-after", "2", "--no-plain"], "--no-plain: not available with --retrofit-after"),
    ],
)
def test_bad_input_is_refused_before_anything_trains(setup, tmp_path, arguments, message):
    out = tmp_path / "study"
    result = runner.invoke(app, ["ab", str(setup["recipe"]), *arguments, "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not out.exists() and not (tmp_path / "study-runs").exists()


def test_a_pretrained_source_is_refused(setup, tmp_path):
    model = tiny_model_folder(tmp_path / "tiny-llama")
    recipe = write_recipe(
        tmp_path / "pretrained.yaml",
        tiny_recipe(model, setup["corpus"], tmp_path / "unused", train={"trainable": "full"}, retrofit={"steps": 2}),
    )
    out = tmp_path / "study"
    result = runner.invoke(app, ["ab", str(recipe), "--retrofit-after", "2", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert (
        f"--retrofit-after: the study pretrains its baseline from scratch, but model.from_scratch is false (model.source is {model}"
        in " ".join(result.output.split())
    )
    assert not out.exists() and not (tmp_path / "study-runs").exists()


def test_the_held_out_standard_error_is_over_sequences():
    """loss_se: the ratio estimator's standard error over the held-out sequences, computed here by hand from each
    sequence's own loss (padded sequences included, which weigh by their predictions)."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    import torch.nn.functional as F
    from tiny_models import tiny_model

    from attnres_convert.finetune.evaluation import heldout_loss_across_processes
    from attnres_convert.io.text import Sequences

    model = tiny_model("llama").eval()
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 100, size=(5, 12)).astype(np.int32)
    lengths = np.array([12, 12, 7, 12, 3], dtype=np.int32)
    for row, length in enumerate(lengths):
        tokens[row, length:] = 0
    sequences = Sequences(tokens, lengths, 0)
    accelerator = SimpleNamespace(process_index=0, num_processes=1, device="cpu", reduce=lambda tensor, _: tensor)
    heldout = heldout_loss_across_processes(model, sequences, accelerator, batch_size=2)
    loss, count, se = heldout.loss, heldout.predictions, heldout.se
    sums, counts = [], []
    with torch.no_grad():
        for row, length in enumerate(lengths):
            ids = torch.from_numpy(tokens[row : row + 1, :length].astype(np.int64))
            logits = model(input_ids=ids).logits[0, :-1]
            sums.append(float(F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")))
            counts.append(length - 1)
    mean = sum(sums) / sum(counts)
    n = len(sums)
    expected = math.sqrt(n / (n - 1) * sum((s - mean * c) ** 2 for s, c in zip(sums, counts))) / sum(counts)
    assert count == sum(counts) and loss == pytest.approx(mean, rel=1e-5)
    assert se == pytest.approx(expected, rel=1e-4) and se > 0
    assert heldout.sequence_sums == pytest.approx(sums, rel=1e-5) and heldout.sequence_counts == counts
    # One sequence: no spread to estimate from.
    assert heldout_loss_across_processes(model, Sequences(tokens[:1], lengths[:1], 0), accelerator, 2).se is None

"""Pipeline parallelism under strategy 'fsdp' (``strategy.pp``): how a model is cut into
stages, the options' errors (refused by the dry run), the memory plan against what the stages
hold, and tp x pp on 4 gloo processes killed and resumed bit for bit, against one process.

The shipped tinylm under pp=2 against ddp, its export and its resumes on other meshes are in
test_tensor_parallel.py, beside tp's (they share the runs of ``parallel_runs``)."""

from __future__ import annotations

import pytest
import torch

from tests.plans import dry_run_error, plan_and_measure
from tests.records import losses, records
from tests.runs import TINYLM
from trainrun.cli import verify_resume
from trainrun.cli.plan import main as plan_main
from trainrun.examples.tinylm import TinyLM
from trainrun.runner.config import load_config
from trainrun.runner.runner import Runner
from trainrun.wrappers.memory import KINDS
from trainrun.wrappers.pipeline import check_protocol, cut, parts, shared_parameters

DIGITS = TINYLM.with_name("digits_ddp.yaml")
SMALL = ["data.train.batch_size=8", "data.val=null", "schedule.max_iters=2",
         "logging.interval=1", "logging.backends=[jsonl]", "checkpoint.interval=0",
         "checkpoint.save_last=false"]


def _model(n_layer: int = 4) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(n_layer=n_layer, n_embd=32, n_head=2)


# ---------------------------------------------------------------- cutting a model

def test_the_parts_are_the_children_in_order_with_the_blocks_one_by_one() -> None:
    assert parts(_model()) == ["token_emb", "pos_emb", "drop", "blocks.0", "blocks.1",
                               "blocks.2", "blocks.3", "ln_f", "head"]


@pytest.mark.parametrize(("split", "held"), [
    (None, [["token_emb", "pos_emb", "drop", "blocks.0", "blocks.1"],
            ["blocks.2", "blocks.3", "ln_f", "head"]]),
    (["blocks.1"], [["token_emb", "pos_emb", "drop", "blocks.0"],
                    ["blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]]),
], ids=["evenly", "pp_split"])
def test_each_stage_keeps_its_parts_under_the_plain_names(split, held) -> None:
    """Cut in two, evenly over the blocks or where ``pp_split`` says: the stages' state dicts
    together are the plain model's, key for key and value for value (the tied embedding on
    both ends), and each stage computes its part of the plain forward."""
    whole = _model()
    stages = []
    for stage in range(2):
        part = _model()
        cut(part, 2, stage, split)
        assert [name for name in parts(part) if name in held[stage]] == held[stage]
        stages.append(part)
    plain = whole.state_dict()
    union = {**stages[0].state_dict(), **stages[1].state_dict()}
    assert sorted(union) == sorted(plain)
    assert all(torch.equal(union[key], plain[key]) for key in plain)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert torch.equal(stages[1].pp_forward(stages[0].pp_forward(ids)), whole.logits(ids))


def test_the_tied_embedding_is_one_parameter_under_two_names() -> None:
    assert shared_parameters(_model()) == [["token_emb.weight", "head.weight"]]
    assert shared_parameters(TinyLM(tie_weights=False)) == []


def test_a_model_that_does_not_say_how_it_runs_in_parts_is_refused_naming_what_it_lacks():
    with pytest.raises(ValueError, match=r"strategy.pp: 2 cuts the model into 2 stages, but "
                                         r"Linear does not say how its forward runs in parts: "
                                         r"it needs pp_blocks, pp_inputs, pp_forward, "
                                         r"pp_outputs"):
        check_protocol(torch.nn.Linear(2, 2), 2)


# ---------------------------------------------------------------- the options, by the dry run

@pytest.mark.parametrize(("config", "options", "says"), [
    (TINYLM, ["strategy.pp=3", "strategy.pp_microbatches=4"],
     "strategy.pp 3 x strategy.tp 1 must divide the world size; got 4"),
    (TINYLM, ["strategy.pp=2", "strategy.tp=4"], "strategy.pp 2 x strategy.tp 4 must divide"),
    (TINYLM, ["strategy.pp=0"], "strategy.pp must be a positive int"),
    (TINYLM, ["strategy.pp=2", "strategy.pp_microbatches=1"],
     "strategy.pp_microbatches must be at least pp (2)"),
    (TINYLM, ["strategy.pp=2", "strategy.pp_microbatches=3"],
     "strategy.pp_microbatches: 3 microbatches must divide data.train.batch_size; got 32"),
    (TINYLM, ["strategy.pp=2", "data.train.drop_last=false"],
     "every training batch must be whole; set data.train.drop_last: true"),
    (TINYLM, ["strategy.pp=2", "strategy.pp_schedule=zigzag"],
     "strategy.pp_schedule must be one of gpipe, 1f1b, interleaved_1f1b; got 'zigzag'"),
    (TINYLM, ["strategy.pp=2", "strategy.pp_virtual_stages=2"],
     "strategy.pp_virtual_stages: several stages a rank (2 or more) go with pp_schedule "
     "interleaved_1f1b, one with gpipe or 1f1b; got 2 under 1f1b"),
    (TINYLM, ["strategy.pp=2", "strategy.pp_schedule=interleaved_1f1b"],
     "got 1 under interleaved_1f1b"),
    (TINYLM, ["strategy.pp=2", "strategy.pp_schedule=interleaved_1f1b",
              "strategy.pp_virtual_stages=2"],
     "strategy.pp: 4 stages need at least 4 blocks; TinyLM.blocks has 2"),
    (TINYLM, ["strategy.pp=2", "strategy.pp_split=[blocks.7]"],
     "strategy.pp_split: the model has no part 'blocks.7'; its parts in order: token_emb, "),
    (TINYLM, ["strategy.pp=2", "strategy.pp_split=[blocks.1,ln_f]"],
     "strategy.pp_split names where stages 2 to 2 begin: 1 name(s) for 2 stages; got 2"),
    (TINYLM, ["strategy.pp=4"], "strategy.pp: 4 stages need at least 4 blocks; TinyLM.blocks "
                                "has 2"),
    (TINYLM, ["strategy.pp=2", "strategy.tp=2", "strategy.sequence_parallel=true"],
     "strategy.sequence_parallel does not compose with strategy.pp yet"),
    (DIGITS, ["strategy.type=fsdp", "strategy.pp=2", "data.train.drop_last=true"],
     "strategy.pp: 2 cuts the model into 2 stages, but DigitsMLP does not say how"),
], ids=["pp does not divide", "pp x tp does not divide", "pp zero", "too few microbatches",
        "microbatches do not divide the batch", "a smaller last batch", "unknown schedule",
        "virtual stages without interleaving", "interleaving one stage a rank",
        "too few blocks for the virtual stages",
        "no such part", "too many cuts", "too few blocks",
        "with sequence parallelism", "a model without the protocol"])
def test_a_bad_pp_setting_is_refused_by_the_dry_run(capsys, config, options, says) -> None:
    assert says in dry_run_error(capsys, config, options)


def test_the_plan_counts_the_stages_and_the_data_parallel_ranks(capsys) -> None:
    assert plan_main([str(TINYLM), "--world-size", "4", "--cfg-options", "strategy.pp=2",
                      "strategy.pp_microbatches=4", "strategy.pp_schedule=gpipe"]) == 0
    out = capsys.readouterr().out
    assert "effective 32 x 2 data-parallel ranks (4 / tp 1 x pp 2) x 1 accumulated = 64" in out
    assert "sharded over 2 ranks (sharding full)" in out
    assert "pipeline of 2 stages (strategy.pp): the figures are stage 1's, the largest" in out
    assert "the activations of up to 4 microbatches in flight on the first stage (gpipe" in out


INTERLEAVED = ["model.n_layer=4", "strategy.pp=2", "strategy.pp_schedule=interleaved_1f1b",
               "strategy.pp_virtual_stages=2", "strategy.pp_microbatches=4"]


@pytest.mark.parametrize("options", [["strategy.pp=2"], INTERLEAVED],
                         ids=["1f1b", "interleaved"])
def test_the_plan_is_what_the_largest_stage_holds(run_on, tmp_path, options) -> None:
    """Two ranks of a pipeline: the plan is the rank that holds most (the first: the tied
    token embedding and the position embedding beside its blocks; the last holds the final
    norm and the tied head beside its own), exactly; one stage a rank, or two (4 blocks,
    interleaved: rank 0 holds stages 1 and 3)."""
    options = [*SMALL, *options, "launcher=pytorch"]
    results = run_on(2)(plan_and_measure, str(TINYLM), options, str(tmp_path / "run"))
    planned = results[0][0]
    for kind in KINDS:
        held = [measured[kind] for _, measured in results]
        assert held[0] > held[1] > 0, (kind, results)
        assert planned[kind] == held[0], (kind, results)


def _interleaved_body(work_dir: str, options: list[str], resume: str | None = None
                      ) -> dict[int, float]:
    """6 steps of a 4-block tinylm, a checkpoint every 3, under ``options`` (from ``resume``
    where given); rank 0's logged losses."""
    cfg = load_config(str(TINYLM), [*SMALL, "model.n_layer=4", "schedule.max_iters=6",
                                     "checkpoint.interval=3", *options, f"work_dir={work_dir}",
                                     *([f"resume={resume}"] if resume else [])])
    with Runner.from_cfg(cfg) as runner:
        runner.train()
        rank = runner.rank
    return losses(work_dir) if rank == 0 else {}


def test_an_interleaved_pipeline_logs_the_losses_of_one_process_and_resumes_exactly(
        run_on, tmp_path) -> None:
    """pp=2 with 2 stages a rank (interleaved_1f1b) on 2 ranks: the losses of one process on
    the same batches within 1e-6 (measured: 2e-7), and resumed from its step-3 checkpoint,
    steps 4-6 bit for bit."""
    plain = run_on(1)(_interleaved_body, str(tmp_path / "one"),
                      ["strategy.type=none", "launcher=none"])[0]
    options = [*INTERLEAVED[1:], "launcher=pytorch"]
    split = run_on(2)(_interleaved_body, str(tmp_path / "pp"), options)[0]
    assert sorted(split) == sorted(plain) == list(range(1, 7))
    assert all(abs(split[s] - plain[s]) / plain[s] < 1e-6 for s in split), (split, plain)
    checkpoint = str(tmp_path / "pp" / "checkpoints" / "iter_3.pth")
    resumed = run_on(2)(_interleaved_body, str(tmp_path / "resumed"), options, checkpoint)[0]
    assert resumed == {s: split[s] for s in (4, 5, 6)}


def _accumulating_body(work_dir: str, options: list[str]) -> list[dict]:
    """4 steps of 2 accumulated micro-steps under ``options``; rank 0's training records."""
    cfg = load_config(str(TINYLM), [*SMALL, "schedule.max_iters=4", "optim.accumulate=2",
                                     "logging.interval=2", *options, f"work_dir={work_dir}"])
    with Runner.from_cfg(cfg) as runner:
        runner.train()
        rank = runner.rank
    return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in records(work_dir)
            if "loss" in r] if rank == 0 else []


TEST_DATA = ["data.test.type=char_corpus", "data.test.split=val", "data.test.block_size=64",
             "data.test.batch_size=48", "data.test.metrics=[val_loss]"]


def _test_body(work_dir: str, checkpoint: str, options: list[str]) -> dict[str, float]:
    """On every rank: test ``checkpoint`` on the validation text under ``options``."""
    cfg = load_config(str(TINYLM), [*SMALL, *TEST_DATA, *options, f"load_from={checkpoint}",
                                     f"work_dir={work_dir}"])
    with Runner.from_cfg(cfg) as runner:
        return runner.test()


def test_a_pp_checkpoint_tests_through_the_stages_as_in_one_process(run_on, tmp_path) -> None:
    """Weights trained under pp=2 (2 steps; a DCP directory of the two stages' parts), tested
    under pp=2 (the whole batches through the stages, the last one smaller) and in one
    process: the same score, within 1e-6."""
    run_on(2)(_held_body, str(tmp_path / "run"), ["checkpoint.save_last=true"])
    checkpoint = str(tmp_path / "run" / "checkpoints" / "iter_2.pth")
    split = run_on(2)(_test_body, str(tmp_path / "pp"), checkpoint,
                      ["strategy.pp=2", "launcher=pytorch"])
    plain = run_on(1)(_test_body, str(tmp_path / "one"), checkpoint,
                      ["strategy.type=none", "launcher=none"])[0]
    assert split[0] == split[1]  # the last stage's score, on both
    assert abs(split[0]["val_loss"] - plain["val_loss"]) / plain["val_loss"] < 1e-6, \
        (split, plain)


def test_accumulated_micro_steps_step_as_one_process_does(run_on, tmp_path) -> None:
    """``optim.accumulate: 2`` under pp=2 (one data-parallel rank): each optimiser step
    applies the mean of both micro-steps' gradients, as one process does; within 1e-5
    (measured: 2e-7). A schedule that divided every gradient it held by the microbatches
    would halve the first micro-step's (the gradient norm a quarter off)."""
    plain = run_on(1)(_accumulating_body, str(tmp_path / "plain"),
                      ["strategy.type=none", "launcher=none"])[0]
    split = run_on(2)(_accumulating_body, str(tmp_path / "pp"),
                      ["strategy.pp=2", "launcher=pytorch"])[0]
    assert [r["step"] for r in split] == [r["step"] for r in plain] == [2, 4]
    for ours, theirs in zip(split, plain, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(ours[key] - theirs[key]) / theirs[key] < 1e-5, (split, plain)


# ---------------------------------------------------------------- tp x pp, killed and resumed

def _single_process_body(work_dir: str, steps: int) -> dict[int, float]:
    cfg = load_config(str(TINYLM), [f"schedule.max_iters={steps}", "logging.interval=1",
                                     "data.val=null", "strategy.type=none", "launcher=none",
                                     f"work_dir={work_dir}"])
    with Runner.from_cfg(cfg) as runner:
        runner.train()
    return losses(work_dir)


@pytest.mark.slow
def test_tp_x_pp_killed_mid_run_resumes_bit_for_bit_and_logs_the_losses_of_one_process(
        capsys, run_on, tmp_path) -> None:
    """tp=2 x pp=2 on 4 processes (one data-parallel rank, gpipe, with an EMA of the weights):
    SIGKILLed after a checkpoint and resumed, it logs the unbroken run's losses bit for bit;
    and those are the losses of one plain process on the same batches, within 1e-4 (measured:
    2e-5 over 12 steps; 8 here, before the loss jumps at step 9)."""
    work_dir = tmp_path / "verify"
    code = verify_resume.main([str(TINYLM), "--nproc", "4", "--steps", "8", "--work-dir",
                               str(work_dir), "--keep", "--cfg-options", "strategy.tp=2",
                               "strategy.pp=2", "strategy.pp_schedule=gpipe",
                               "schedule.val_interval=4",
                               "hooks=[{type: EMA, momentum: 0.01, warmup: 2}]"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert any(line.startswith("interrupted: killed with SIGKILL after step ")
               for line in out.splitlines()), out
    assert "exact resume: the losses of steps 1-8 match bit for bit" in out, out
    assert "validation at step 8: val_loss " in out and " in both runs" in out, out
    split = losses(work_dir / "straight")
    plain = run_on(1)(_single_process_body, str(tmp_path / "plain"), 8)[0]
    assert sorted(split) == sorted(plain) == list(range(1, 9))
    assert all(abs(split[s] - plain[s]) / plain[s] < 1e-4 for s in split), (split, plain)
    assert any(r.get("mode") == "val" for r in records(work_dir / "straight"))


def _held_body(work_dir: str, options: list[str] | None = None) -> dict:
    """On every rank: 2 steps under pp=2 (and ``options``); the parts this rank's stage holds,
    and the losses rank 0 logged."""
    cfg = load_config(str(TINYLM), [*SMALL, "strategy.pp=2", "launcher=pytorch",
                                     *(options or []), f"work_dir={work_dir}"])
    with Runner.from_cfg(cfg) as runner:
        runner.train()
        held = parts(runner.strategy.unwrap(runner.model))
        logged = losses(work_dir) if runner.rank == 0 else None
    return {"parts": held, "losses": logged}


def test_a_stage_holds_its_part_and_the_first_logs_the_last_ones_loss(run_on, tmp_path):
    """Each of 2 ranks holds half the blocks: rank 0 the embeddings, rank 1 the final norm and
    the head (the tied weight on both). Rank 0 logs the loss that only the last stage
    computes."""
    held = run_on(2)(_held_body, str(tmp_path / "run"))
    assert held[0]["parts"] == ["token_emb", "pos_emb", "drop", "blocks.0"]
    assert held[1]["parts"] == ["blocks.1", "ln_f", "head"]
    logged = held[0]["losses"]
    assert sorted(logged) == [1, 2] and all(3.0 < loss < 5.0 for loss in logged.values())

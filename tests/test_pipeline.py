"""Pipeline parallelism on real torchrun with gloo ranks: one launch of two ranks runs every case
(``tests/pipeline_worker.py``): each design and schedule pipelines one training step and is
compared, on every rank, with one process running the same micro-batches, the AttnRes family
with the cross-stage cache off and on; one launch of four runs Block in 8 interleaved stages."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from attnres.train.parallel_plan import MULTI_STAGE, SCHEDULES, plan_parallel
from attnres.train.pipeline_stages import stage_modules
from attnres.train.stage_cache import sources_held
from attnres.train.validate import check_run

from .conftest import tiny_model
from .pipeline_worker import DESIGNS, MOE, OTHERS

REPO = Path(__file__).resolve().parents[1]

# under pytest-xdist the module runs in one worker, which launches each job once; the torchrun
# launches take a minute, so the module is in the slow step (make test-slow)
pytestmark = [pytest.mark.xdist_group("pipeline_launches"), pytest.mark.slow]


def launch(tmp_path_factory, ranks: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"pipeline{ranks}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone",
                           "-m", "tests.pipeline_worker", str(out)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return launch(tmp_path_factory, 4)


#: a gradient's largest difference to one process, relative to its largest entry: fp32's
#: round-off of summing the same terms in another order. A window's gradients are the most
#: sensitive to order: one process's own fp32 gradients of ``full-window`` are 1.3e-6 (reference
#: backend) and 2.4e-6 (CPU kernels) off fp64's, Full's 6e-7.
GRAD_TOLERANCE = {"full-window": 4e-6}


def grad_tolerance(design: str) -> float:
    return GRAD_TOLERANCE.get(design, 1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipelined_step_equals_one_process_with_the_same_micro_batches(results, schedule):
    """The loss bit for bit and every gradient within 1e-6 relative (a window's within 4e-6,
    ``GRAD_TOLERANCE``), on both ranks: every design (uneven blocks and a window included)
    under GPipe, 1F1B, interleaved 1F1B and ZBV; Block and Delta under looped BFS and
    DualPipeV."""
    for rank in results:
        for design in OTHERS.get(schedule, DESIGNS):
            r = rank[f"{design}/{schedule}"]
            assert r["loss"] == r["ref_loss"], (design, r)
            assert r["max_rel_grad"] <= grad_tolerance(design), (design, r)
    # a running sum's gradients cross the boundary unchanged: bitwise where each stage owns its
    # parameters' reads (the schedules that keep one process's accumulation order)
    if schedule not in OTHERS:
        assert all(rank[f"prenorm/{schedule}"]["bitwise"] for rank in results)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
def test_a_mixture_of_experts_model_pipelines_with_its_balance_loss(results, schedule):
    """Block AttnRes with 4 experts per MLP and the balance loss at weight 0.5: each stage's
    part of the balance loss reaches its routers (every gradient within 1e-6 relative of one
    process's with the balance loss), and the step's loss is the language model's, as one
    process logs it."""
    for rank in results:
        r = rank[f"moe/{schedule}"]
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * r["ref_loss"], r
        assert r["max_rel_grad"] <= 1e-6, r


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_tied_embedding_is_summed_over_the_ranks_that_hold_it(results, schedule):
    """Block AttnRes with the head tied to the embedding: under 1F1B the first rank holds it as
    the embedding and the last as the head, and its gradient, summed over the two, is one
    process's (within 1e-6, the loss bit for bit); under ZBV rank 0 holds both ends, and the
    other rank holds neither."""
    for index, rank in enumerate(results):
        r = rank[f"tied/{schedule}"]
        assert r["loss"] == r["ref_loss"] and r["max_rel_grad"] <= 1e-6, r
        held = set(r["held"])
        ends = {"tok_embeddings.weight", "lm_head.weight"}
        expected = ({"tok_embeddings.weight"} if index == 0 else {"lm_head.weight"}) if schedule == "1f1b" else (
            ends if index == 0 else set())
        assert held & ends == expected, (schedule, index, held & ends)


def test_a_rank_holds_evaluates_and_clips_only_its_part(results):
    """Each rank's state dict holds exactly its stages' sublayers, the embedding where the first
    stage lives, the head where the last lives, and the stream; evaluation through the pipeline
    gives one process's loss bit for bit, and the gradient norm summed over the pipeline (the
    stream's rows counted once) one process's within 1e-6."""
    from attnres.model import Transformer
    from attnres.train.stage_local import trim

    checked = 0
    for index, rank in enumerate(results):
        for key, r in rank.items():
            design, schedule = key.split("/")[:2]
            extra = {"moe": MOE, "tied": dict(tie_embeddings=True)}.get(design, {})
            config = tiny_model("block" if extra else design, n_layers=4, **extra).config
            with torch.device("meta"):
                plan = plan_parallel(config, 2, pp_size=2, schedule=schedule)
                expected = trim(Transformer(config, initialize=False), plan.part(index))
            assert r["held"] == sorted(expected.state_dict()), key
            assert r["stages"] == [stage.index for stage in plan.stages_of(index)]
            assert r["eval_loss"] == r["ref_eval_loss"], (key, r)
            assert abs(r["norm"] - r["ref_norm"]) <= 1e-6 * r["ref_norm"], (key, r)
            checked += 1
    held = results[0]["block/1f1b"]["held"]
    assert "tok_embeddings.weight" in held and "lm_head.weight" not in held
    assert "layers.0.attn.wq.weight" in held and "layers.2.attn.wq.weight" not in held
    assert "lm_head.weight" in results[1]["block/1f1b"]["held"]
    assert checked >= 64


CACHED = ("block", "mhar", "mhar-uneven", "full", "full-window", "delta", "denseformer")


@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_the_cross_stage_cache_gives_the_same_step(results, schedule):
    """With the cache on, the AttnRes family's pipelined step equals one process as without it:
    the loss bit for bit, every gradient within 1e-6 relative of one process and of the step
    without the cache (the cached sources' gradients are summed in another order: not bit for
    bit, see ``stage_cache``); nothing is left in the cache after the step."""
    for rank in results:
        for design in set(CACHED) & set(OTHERS.get(schedule, DESIGNS)):
            r = rank[f"{design}/{schedule}/cache"]
            assert r["cached"] and not rank[f"{design}/{schedule}"]["cached"], design
            assert r["loss"] == r["ref_loss"], (design, r)
            tolerance = grad_tolerance(design)
            assert r["max_rel_grad"] <= tolerance and r["max_rel_to_off"] <= tolerance, (design, r)
            assert r["left_in_cache"] == 0, (design, r)


def sources_at(model, cut: int) -> tuple[int, int]:
    """``(completed sources, other tensors)`` of the state before sublayer ``cut``, counted from
    the design's definition, in ``[tokens, D]`` tensors: PreNorm's running sum; the ``n`` streams
    of HC/mHC/GR; Full's and DenseFormer's ``e`` and one source per sublayer; Block's ``e``, one per finished block
    and the partial mid-block; Delta's the same and its running sum ``h``."""
    kind = model.config.residual
    if kind == "prenorm":
        return 0, 1
    if kind in ("hc", "mhc", "gr"):
        return 0, model.config.streams
    if kind in ("full", "denseformer"):
        return cut + 1, 0
    ends = [sum(model.stream.block_sizes[: k + 1]) for k in range(len(model.stream.block_sizes))]
    return 1 + sum(end <= cut for end in ends), int(cut not in ends) + (kind == "delta")


#: stage -> the cut its rank's cached sources reach when the stage runs: 4 stages of 2 sublayers
#: on 2 ranks; looped: rank r holds r and r + 2; V: rank 0 holds 0 and 3, rank 1 holds 1 and 2
#: (their hop stays on the rank, nothing cached)
HELD_CUT = {"interleaved1f1b": {2: 2, 3: 4}, "loopedbfs": {2: 2, 3: 4}, "zbv": {3: 2}, "dualpipev": {3: 2}}


@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_a_hop_carries_what_the_design_needs_and_with_the_cache_only_what_the_rank_has_not_seen(results,
                                                                                                schedule):
    """The bytes the engine received per hop and micro-batch (2 x 8 tokens of dim 32 in fp32:
    2 KiB per tensor) against the count from each design's definition; with the cache, the
    sources the receiving rank holds are not sent."""
    from .conftest import tiny_model

    unit = 2 * 8 * 32 * 4
    checked = 0
    for rank in results:
        for design in OTHERS.get(schedule, DESIGNS):
            model = tiny_model(design, n_layers=4)
            for key, cached in ((f"{design}/{schedule}", False), (f"{design}/{schedule}/cache", True)):
                if key not in rank:
                    continue
                for stage, got in rank[key]["received"].items():
                    cut = 2 * int(stage)
                    completed, other = sources_at(model, cut)
                    held = sources_at(model, HELD_CUT[schedule][int(stage)])[0] if cached and int(
                        stage) in HELD_CUT[schedule] else 0
                    assert got == (completed - held + other) * unit, (key, stage, got, completed, held, other)
                    checked += 1
    assert checked >= 8


def test_four_ranks_of_two_stages_with_the_cache_looped_and_in_a_v(results4):
    """A tied embedding in 4 stages on 4 ranks (held by ranks 0 and 3, summed over all four):
    one process's step and gradient norm. Block AttnRes (blocks of 3) in 8 stages of one
    sublayer on 4 ranks: the same step as one
    process with and without the cache, looped (interleaved 1F1B) and in a V (ZBV, rank r holding
    r and 7 - r, where a stage passes on a source it read from its rank's cache). Tensors per hop,
    without and with the cache:
    - looped, into stage 7 (cut 7: e, B_0, B_1 and the partial; rank 3 holds e and B_0 from
      stage 3): 4 and 2;
    - V, into stage 5 (cut 5: e, B_0 and the partial; rank 2 holds e and B_0 from stage 2): 3
      and 1; into stage 6 (e, B_0, B_1; rank 1 holds e from stage 1): 3 and 2; into stage 7
      (e, B_0, B_1 and the partial; rank 0 holds e): 4 and 3."""
    unit = 2 * 8 * 32 * 4
    for rank in results4:
        for schedule in ("interleaved1f1b", "zbv"):
            for key in (f"block/{schedule}", f"block/{schedule}/cache"):
                r = rank[key]
                assert r["loss"] == r["ref_loss"] and r["max_rel_grad"] <= 1e-6, (key, r)
            assert rank[f"block/{schedule}/cache"]["max_rel_to_off"] <= 1e-6
            assert rank[f"block/{schedule}/cache"]["left_in_cache"] == 0
    # a tied embedding on 4 ranks of one stage each: the two middle ranks send zeros for it
    for index, rank in enumerate(results4):
        r = rank["tied/1f1b"]
        assert r["loss"] == r["ref_loss"] and r["max_rel_grad"] <= 1e-6, (index, r)
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-6 * r["ref_norm"], (index, r)
        ends = {"tok_embeddings.weight", "lm_head.weight"} & set(r["held"])
        assert ends == [{"tok_embeddings.weight"}, set(), set(), {"lm_head.weight"}][index]
    expected = {("interleaved1f1b", 3, "7"): (4, 2), ("zbv", 2, "5"): (3, 1), ("zbv", 1, "6"): (3, 2),
                ("zbv", 0, "7"): (4, 3)}
    for (schedule, rank, stage), (off, on) in expected.items():
        assert results4[rank][f"block/{schedule}"]["received"][stage] == off * unit, (schedule, stage)
        assert results4[rank][f"block/{schedule}/cache"]["received"][stage] == on * unit, (schedule, stage)


def test_a_cached_gradient_reaches_its_owner_or_the_step_says_so():
    """One rank's cache in one process: a later stage reads a source its earlier stage owns;
    the reader's gradient joins the owner's in the owner's backward, and a gradient left
    undelivered (the owner's backward never ran) is an error, not a silent loss. A source that
    takes no gradient gives a reader nothing to deliver."""
    from attnres.train.stage_cache import SourceCache

    cache = SourceCache()
    x = torch.randn(4, requires_grad=True)
    frozen = torch.randn(4)
    owned, kept = cache.own(0, 0, [x * 2, frozen])
    (leaf, unlearned) = cache.read(0, 2, stage=2)
    assert leaf.requires_grad and not unlearned.requires_grad
    cache.drop(0)  # the rank's last stage has read them
    (leaf * 3).sum().backward()  # the later stage's backward first
    with pytest.raises(RuntimeError, match=r"1 cached source\(s\) kept a gradient their owning stage never took"):
        cache.check_delivered()
    (owned * 5).sum().backward()  # the owner's: its own 5 and the reader's 3, times d(2x)/dx
    assert torch.equal(x.grad, torch.full((4,), 16.0)) and kept is frozen
    cache.check_delivered()
    assert len(cache) == 0


def test_a_cached_stage_needs_its_micro_batch():
    from .conftest import tiny_model

    model = tiny_model("block", n_layers=4)
    plan = plan_parallel(model.config, 2, pp_size=2, schedule="interleaved1f1b", cache="on")
    first = stage_modules(model, plan)[0]
    with pytest.raises(ValueError, match=r"stage 0 reads and fills its rank's cache of sources: call it with "
                                         r"microbatch="):
        first(torch.zeros(1, 4, dtype=torch.long))


def test_which_sources_a_rank_holds_follows_the_placement():
    # looped, 2 ranks x 2: stage 2 holds what stage 0 completed, stage 3 what stage 1 did
    assert sources_held([0, 1, 0, 1], [1, 2, 3, 4]) == [0, 0, 1, 2]
    # V on 2 ranks: stage 2 follows stage 1 on its rank (handed over in memory), stage 3 holds stage 0's
    assert sources_held([0, 1, 1, 0], [1, 2, 3, 4]) == [0, 0, 0, 1]


@pytest.mark.parametrize("sets,message", [
    (["run.pp_size=2", "run.pp_schedule=pipedream"], "run.pp_schedule='pipedream' must be one of"),
    (["run.pp_size=2", "run.pp_microbatches=3"], "3 micro-batches must be a positive integer dividing the batch of 4"),
    (["run.pp_size=2", "run.pp_microbatches=1"], "'1f1b' needs at least as many micro-batches as stages (2), given 1"),
    (["run.pp_size=8"], "8 stages for 4 sublayers: a stage needs at least one sublayer"),
    (["run.pp_size=2", "run.pp_split=3,2"], "split=[3, 2] must be 2 positive sublayer counts summing to 4"),
    (["run.pp_size=2", "run.grad_accum=2"], "grad_accum is not supported with it"),
    (["run.pp_size=2", "run.pp_schedule=zbv", "run.pp_stages_per_rank=3"], "runs exactly 2 stages per rank, given 3"),
    (["run.pp_microbatches=2"], "apply to a pipelined run: set run.pp_size > 1"),
    (["run.pp_cache=on"], "run.pp_cache='on': run.pp_split, run.pp_microbatches, run.pp_stages_per_rank and "
                          "run.pp_cache apply to a pipelined run: set run.pp_size > 1"),
    (["run.pp_size=2", "model.residual=block", "run.pp_cache=on"], "with 1 stage per rank there are none"),
    (["run.pp_size=2", "run.pp_cache=sometimes"], "run.pp_cache='sometimes' must be one of"),
    (["run.pp_size=2", "model.residual=prenorm", "run.pp_cache=on"],
     "run.pp_cache='on' keeps the completed sources of the designs that store them ('full', 'block', 'delta', 'denseformer'); "
     "model.residual='prenorm'"),
])
def test_bad_pipeline_options_are_refused_before_any_work(sets, message):
    from attnres.train.config import apply_override, tiny

    cfg = tiny()  # 2 layers (4 sublayers), batch 4
    for assignment in sets:
        cfg = apply_override(cfg, assignment)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_run(cfg)


def test_a_pipeline_without_its_processes_is_refused_in_one_line(tmp_path, capsys):
    from attnres.cli import main

    assert main(["train", "--preset", "tiny", "--set", "run.pp_size=2", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "run.pp_size=2 must divide the job's 1 processes" in err
    assert not (tmp_path / "run").exists()

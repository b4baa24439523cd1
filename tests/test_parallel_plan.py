"""The parallel plan: one frozen object, built and checked by one function, that says which rank
holds which stages and sublayers, what the ranks share and how they are wrapped."""

import ast
import dataclasses
from pathlib import Path

import pytest

from attnres.train import parallel_plan
from attnres.train.parallel_plan import ParallelPlan, Stage, plan_parallel, run_plan

from .conftest import tiny_config

PACKAGE = Path(parallel_plan.__file__).resolve().parent.parent
#: the layout helpers: what derives a layout from a schedule's name
LAYOUT_HELPERS = ("_stages_per_rank", "_stage_sizes", "_stage_bounds", "_stage_ranks", "_check_cache")


def bounds(plan: ParallelPlan) -> list[tuple[int, int]]:
    return [(s.first, s.last) for s in plan.stages]


def test_the_plan_is_frozen():
    plan = plan_parallel(tiny_config(n_layers=4), 2, pp_size=2)
    for field, value in (("pp_size", 4), ("cache", True), ("stages", ())):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, field, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages[0].rank = 1


def test_only_the_builder_calls_the_layout_helpers():
    """Every reference to a layout helper in the package is inside ``plan_parallel``'s body (the
    helpers' own definitions aside): nothing else re-derives a layout."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        builder = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "plan_parallel"]
        inside = {id(node) for b in builder for node in ast.walk(b)}
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in LAYOUT_HELPERS:
                found.append((path.relative_to(PACKAGE).as_posix(), name, id(node) in inside))
            if isinstance(node, (ast.ImportFrom, ast.Import)):
                assert not {a.name for a in node.names} & set(LAYOUT_HELPERS), path
    assert found and all(inside for _, _, inside in found), [f for f in found if not f[2]]
    assert {path for path, _, _ in found} == {"train/parallel_plan.py"}
    assert {name for _, name, _ in found} == set(LAYOUT_HELPERS)  # the check sees every helper


def test_stages_cover_the_sublayers_as_given_or_evenly():
    eight = tiny_config(n_layers=4)  # 8 sublayers
    assert bounds(plan_parallel(eight, 2, pp_size=2)) == [(0, 4), (4, 8)]
    assert bounds(plan_parallel(eight, 3, pp_size=3, microbatches=3)) == [(0, 3), (3, 6), (6, 8)]
    assert bounds(plan_parallel(eight, 3, pp_size=3, split=[2, 5, 1])) == [(0, 2), (2, 7), (7, 8)]


@pytest.mark.parametrize("schedule,owners", [
    ("gpipe", (0, 1)), ("1f1b", (0, 1)),
    ("interleaved1f1b", (0, 1, 0, 1)), ("loopedbfs", (0, 1, 0, 1)),  # rank r holds r, r + P
    ("zbv", (0, 1, 1, 0)), ("dualpipev", (0, 1, 1, 0)),  # rank r holds r and 2P - 1 - r
])
def test_each_schedule_places_its_stages(schedule, owners):
    plan = plan_parallel(tiny_config(n_layers=4), 2, pp_size=2, schedule=schedule)
    assert plan.owners == owners
    assert [s.index for s in plan.stages] == list(range(len(owners)))
    assert [s.index for s in plan.stages_of(1)] == [s for s, r in enumerate(owners) if r == 1]
    part = plan.part(0)
    assert part.sublayers == frozenset(i for s in plan.stages_of(0) for i in range(s.first, s.last))
    assert part.first and part.last == (owners[-1] == 0)


def test_the_cache_the_shared_parameters_and_the_wrapping():
    block = tiny_config(n_layers=4, residual="block", block_size=2)
    looped = plan_parallel(block, 2, pp_size=2, schedule="interleaved1f1b")
    assert looped.cache and not plan_parallel(block, 2, pp_size=2).cache  # auto: several stages per rank
    assert not plan_parallel(block, 2, pp_size=2, schedule="interleaved1f1b", cache="off").cache
    assert not plan_parallel(tiny_config(n_layers=4), 2, pp_size=2, schedule="zbv").cache  # prenorm: nothing to keep
    assert looped.shared and all(name.startswith("stream.") for name in looped.shared)
    tied = plan_parallel(tiny_config(n_layers=4, tie_embeddings=True), 2, pp_size=2)
    assert tied.shared[-1] == "tok_embeddings.weight"
    assert plan_parallel(block, 1).wrapping == "none" and plan_parallel(block, 4, parallel="fsdp").wrapping == "fsdp"
    copies = plan_parallel(block, 4, pp_size=2, parallel="fsdp", batch=8)
    assert (copies.wrapping, copies.mesh_shape, copies.shards_stages, copies.model_shards) == (
        "pipeline+fsdp", (2, 2), True, 4)
    assert [copies.pipeline_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [copies.copy_index(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan_parallel(block, 4, pp_size=2, batch=8).model_shards == 2  # DDP copies each hold their pipeline's
    whole = plan_parallel(block, 2)
    assert whole.stages == (Stage(0, 0, 8, 0),) and whole.part(0).first and whole.part(0).last


@pytest.mark.parametrize("layers,options,message", [
    (2, dict(processes=5, pp_size=5, schedule="gpipe"), r"5 stages for 4 sublayers: a stage needs at least one sublayer"),
    (4, dict(processes=3, pp_size=3, split=[4, 4]), r"split=\[4, 4\] must be 3 positive sublayer counts summing to 8"),
    (4, dict(processes=2, pp_size=2, split=[8, 0]), r"split=\[8, 0\] must be 2 positive sublayer counts summing to 8"),
    (4, dict(processes=2, pp_size=2, schedule="pipedream"), r"pipeline schedule 'pipedream' is not one of"),
    (4, dict(processes=2, pp_size=2, schedule="zbv", stages_per_rank=3),
     r"run.pp_size=2, run.pp_schedule='zbv': schedule 'zbv' runs exactly 2 stages per rank, given 3"),
    (4, dict(processes=2, pp_size=2, microbatches=3, batch=8),
     r"3 micro-batches must be a positive integer dividing the batch of 8"),
    (4, dict(processes=3, pp_size=2), r"run.pp_size=2 must divide the job's 3 processes"),
    (4, dict(processes=4, pp_size=2, batch=3), r"run.batch_size=3 must be divisible by the 2 copies of the pipeline"),
    (4, dict(processes=4, pp_size=2, batch=4, microbatches=4),
     r"dividing the batch of 2 \(each of the 2 copies of the pipeline takes 2 of run.batch_size=4\)"),
    (4, dict(processes=2, pp_size=2, cache="on"), r"with 1 stage per rank there are none"),
    (4, dict(processes=2, parallel="zero3"), r"run.parallel='zero3' is not one of \('ddp', 'fsdp'\)"),
    (4, dict(processes=0), r"processes=0 must be a positive integer"),
])
def test_a_layout_it_cannot_run_is_refused_naming_the_option(layers, options, message):
    with pytest.raises(ValueError, match=message):
        plan_parallel(tiny_config(n_layers=layers, residual="block", block_size=2), **options)


def test_a_runs_plan_reads_its_settings():
    from attnres.train.config import apply_override, tiny

    cfg = tiny()
    for assignment in ("run.pp_size=2", "run.pp_schedule=interleaved1f1b", "run.pp_microbatches=4",
                       "run.batch_size=8", "model.residual=block", "model.num_blocks=2"):
        cfg = apply_override(cfg, assignment)
    plan = run_plan(cfg, 4)
    assert (plan.processes, plan.pp_size, plan.dp_size, plan.microbatches, plan.cache) == (4, 2, 2, 4, True)
    assert plan.describe()["mesh"] == {"dp": 2, "pp": 2}
    assert len(plan.stages) == 4 and plan.stages_per_rank == 2

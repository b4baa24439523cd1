"""The one validator of a run's settings (``attnres.train.validate``): plain values in (a config
made from a dict, the number of processes), the refusal out, naming the value and what is
accepted, whichever order the settings came in; and it imports no pipeline machinery."""

import itertools
import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from attnres.train.config import apply_override, from_dict, tiny, to_dict
from attnres.train.parallel_plan import run_plan
from attnres.train.validate import check_run


def config(settings: dict):
    """``tiny()`` (2 layers: 4 sublayers, batch 4, seq_len 32, context 64) with ``settings``
    (``section.field`` -> value), built from plain data as a saved config is."""
    data = to_dict(tiny())
    for key, value in settings.items():
        section, name = key.split(".")
        data[section][name] = value
    return from_dict(data)


def refusal(settings: dict, processes=None) -> str:
    with pytest.raises(ValueError) as err:
        check_run(config(settings), processes)
    return str(err.value)


PP = {"run.pp_size": 2}
# (settings, processes, the whole message): every check, in check_run's order
CASES = [
    # 1. each field's type and range
    ({"optim.grad_clip": -1.0}, None, "optim.grad_clip=-1.0 must be in (0, inf)"),
    ({"run.steps": 0}, None, "run.steps=0 must be an integer in [1, inf)"),
    ({"run.steps": True}, None, "run.steps=True must be an integer in [1, inf)"),
    ({"run.batch_size": 4.0}, None, "run.batch_size=4.0 must be an integer in [1, inf)"),
    ({"optim.lr": float("inf")}, None, "optim.lr=inf must be in (0, inf)"),
    ({"data.val_fraction": 1.0}, None, "data.val_fraction=1.0 must be in (0, 1)"),
    ({"data.tokenizer": "word"}, None, "data.tokenizer='word' must be one of ('byte', 'bpe', 'model')"),
    ({"run.pp_microbatches": 0}, None, "run.pp_microbatches=0 must be an integer in [1, inf) or None"),
    ({"run.pp_schedule": "pipedream"}, None,
     "run.pp_schedule='pipedream' must be one of ('gpipe', '1f1b', 'interleaved1f1b', 'loopedbfs', 'zbv', 'dualpipev')"),
    # 2. the settings that must agree with the model, its residual options by the stream ...
    ({"run.seq_len": 65}, None, "run.seq_len=65 exceeds model.max_seq_len=64"),
    ({"model.residual": "block", "model.heads": 3}, None, "heads=3 must be a positive integer dividing dim=32"),
    ({"model.residual": "block", "model.block_size": 99}, None,
     "block_size=99 must be an integer in [1, 4] (the number of sublayers)"),
    # ... and the fields that must agree
    ({"run.grad_accum": 3}, None, "run.batch_size=4 must be divisible by run.grad_accum=3"),
    ({"run.device": "gpu"}, None, "run.device='gpu' must be 'auto' or a torch device such as 'cpu' or 'cuda:0'"),
    # 3. the pipeline's options: none without a pipeline ...
    ({"run.pp_split": (2, 2), "run.pp_cache": "off"}, None,
     "run.pp_split=(2, 2), run.pp_cache='off': run.pp_split, run.pp_microbatches, run.pp_stages_per_rank and "
     "run.pp_cache apply to a pipelined run: set run.pp_size > 1"),
    # ... and with one, what it cannot run with
    ({**PP, "run.grad_accum": 2}, None, "run.pp_size=2: a pipelined run takes its micro-batches from "
     "run.pp_microbatches and runs eagerly; grad_accum is not supported with it"),
    ({**PP, "run.compile": True}, None, "run.pp_size=2: a pipelined run takes its micro-batches from "
     "run.pp_microbatches and runs eagerly; compile is not supported with it"),
    # the schedule's stages per rank, the stages' sublayers, the micro-batches
    ({**PP, "run.pp_stages_per_rank": 2}, None, "run.pp_size=2, run.pp_schedule='1f1b': schedule '1f1b' runs one "
     "stage per rank, given 2; the looped schedules (interleaved1f1b, loopedbfs) run several"),
    ({**PP, "run.pp_schedule": "loopedbfs", "run.pp_stages_per_rank": 1}, None,
     "run.pp_size=2, run.pp_schedule='loopedbfs': schedule 'loopedbfs' runs 2 or more stages per rank, given 1"),
    ({**PP, "run.pp_schedule": "dualpipev", "run.pp_stages_per_rank": 3}, None,
     "run.pp_size=2, run.pp_schedule='dualpipev': schedule 'dualpipev' runs exactly 2 stages per rank, given 3"),
    ({**PP, "run.pp_schedule": "interleaved1f1b", "run.pp_stages_per_rank": 3}, None,
     "run.pp_size=2, run.pp_schedule='interleaved1f1b': 6 stages for 4 sublayers: a stage needs at least one sublayer"),
    ({**PP, "run.pp_split": (1, 2)}, None,
     "run.pp_size=2, run.pp_schedule='1f1b': split=[1, 2] must be 2 positive sublayer counts summing to 4"),
    ({**PP, "run.pp_microbatches": 3}, None,
     "run.pp_size=2, run.pp_schedule='1f1b': 3 micro-batches must be a positive integer dividing the batch of 4"),
    ({**PP, "run.pp_schedule": "dualpipev", "run.pp_microbatches": 2}, None, "run.pp_size=2, "
     "run.pp_schedule='dualpipev': schedule 'dualpipev' needs at least as many micro-batches as stages (4), given 2"),
    # the cross-stage cache
    ({**PP, "model.residual": "block", "run.pp_cache": "on"}, None, "run.pp_size=2, run.pp_schedule='1f1b': "
     "run.pp_cache='on' keeps what a rank saw at its earlier stages; with 1 stage per rank there are none "
     "(the looped and V schedules run several)"),
    ({**PP, "run.pp_schedule": "zbv", "run.pp_cache": "on"}, None, "run.pp_size=2, run.pp_schedule='zbv': "
     "run.pp_cache='on' keeps the completed sources of the designs that store them ('full', 'block', 'delta', 'denseformer'); "
     "model.residual='prenorm' sends one state that changes at every sublayer"),
    # 4. the placement on the job's processes
    ({}, 3, "run.batch_size=4 must be divisible by world size 3 x run.grad_accum=1"),
    ({"run.grad_accum": 2}, 4, "run.batch_size=4 must be divisible by world size 4 x run.grad_accum=2"),
    (PP, 1, "run.pp_size=2 must divide the job's 1 processes (torchrun --nproc_per_node=N, N a multiple of 2: "
     "the pipelines run side by side)"),
    (PP, 6, "run.batch_size=4 must be divisible by the 3 copies of the pipeline"),
    ({**PP, "run.pp_microbatches": 4, "run.pp_schedule": "gpipe"}, 4,
     "run.pp_size=2, run.pp_schedule='gpipe': 4 micro-batches must be a positive integer dividing the batch of 2 "
     "(each of the 2 copies of the pipeline takes 2 of run.batch_size=4)"),
    ({}, 0, "processes=0 must be a positive integer (the job's world size)"),
]


def case_id(message: str) -> str:
    return re.sub(r"\W+", "-", message)[:60]


@pytest.mark.parametrize("settings,processes,message", CASES, ids=[case_id(m) for _, _, m in CASES])
def test_each_check_refuses_naming_the_value(settings, processes, message):
    assert refusal(settings, processes) == message
    for order in itertools.permutations(settings.items()):  # the same whichever order they come in
        assert refusal(dict(order), processes) == message


def set_options(settings) -> list[str]:
    """``settings`` written as ``--set`` takes them."""
    return [f"{key}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for key, v in settings]


def applied(options) -> object:
    cfg = tiny()
    for option in options:
        cfg = apply_override(cfg, option)
    return cfg


def settable(settings: dict) -> bool:
    """Whether ``--set`` can write ``settings`` (not a bool or a float where a field takes an
    integer) with no residual option among them (``ModelConfig`` refuses an option given
    before the residual kind that takes it)."""
    if not settings or any(key.startswith("model.") for key in settings):
        return False
    try:
        return to_dict(applied(set_options(settings.items()))) == to_dict(config(settings))
    except ValueError:
        return False


SETTABLE = [case for case in CASES if settable(case[0])]


@pytest.mark.parametrize("settings,processes,message", SETTABLE, ids=[case_id(m) for _, _, m in SETTABLE])
def test_the_refusal_is_the_same_whichever_order_the_set_options_come_in(settings, processes, message):
    """``--set`` options applied one after another, in every order: the validator sees the
    settings they end in, and refuses them alike."""
    assert len(SETTABLE) >= 20
    for order in itertools.permutations(settings.items()):
        cfg = applied(set_options(order))
        with pytest.raises(ValueError) as err:
            check_run(cfg, processes)
        assert str(err.value) == message, order


@pytest.mark.parametrize("settings,processes", [
    ({}, None), ({}, 1), ({}, 4), ({"run.grad_accum": 2}, 2),
    (PP, None), (PP, 2), (PP, 4), ({**PP, "run.pp_schedule": "interleaved1f1b", "model.residual": "block",
                                    "run.pp_cache": "on", "run.pp_microbatches": 2}, 4),
    ({**PP, "run.pp_schedule": "zbv", "run.pp_split": (1, 1, 1, 1)}, 2),
])
def test_settings_that_can_run_pass(settings, processes):
    check_run(config(settings), processes)


def test_the_settings_are_checked_before_the_placement():
    """A setting that is wrong on its own is named before a placement the job cannot give."""
    assert refusal({**PP, "run.grad_accum": 2}, 1).endswith("grad_accum is not supported with it")
    assert refusal({"run.seq_len": 65}, 3) == "run.seq_len=65 exceeds model.max_seq_len=64"


def test_the_validator_takes_plain_values_and_leaves_the_config_as_it_was():
    cfg = config({**PP, "run.pp_microbatches": 4})
    before = to_dict(cfg)
    plan = check_run(cfg, 2)
    assert to_dict(cfg) == before and plan == run_plan(cfg, 2) and check_run(cfg) is None
    with pytest.raises(ValueError, match=r"dividing the batch of 2 \(each of the 2 copies"):
        check_run(replace(cfg), 4)


def test_the_validators_schedules_are_the_pipelines():
    """The schedule names the plan holds as plain data are the pipeline module's, and the
    multi-stage ones are those whose ``torch.distributed.pipelining`` class runs several stages
    per rank."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    from attnres.train import parallel_plan, pipeline

    assert parallel_plan.SCHEDULES == tuple(pipeline.SCHEDULE_CLASSES)
    multi = tuple(name for name in parallel_plan.SCHEDULES
                  if issubclass(getattr(pipelining, pipeline.SCHEDULE_CLASSES[name]), PipelineScheduleMulti))
    assert multi == parallel_plan.MULTI_STAGE
    assert set(parallel_plan.V_SHAPED) <= set(parallel_plan.MULTI_STAGE)
    assert set(parallel_plan.NEEDS_A_MICROBATCH_PER_STAGE) <= set(parallel_plan.SCHEDULES)


IMPORTS = """
import importlib, json, sys
WATCHED = ("torch.distributed.pipelining", "attnres.train.pipeline", "attnres.train.stage_cache",
           "attnres.train.distributed", "attnres.train.trainer")
loaded = {}
for module in ("validate", "config", "parallel_plan", "pipeline"):
    importlib.import_module("attnres.train." + module)
    loaded[module] = sorted(m for m in sys.modules if m.startswith(WATCHED))
print(json.dumps(loaded))
"""


def test_the_validator_and_the_config_import_no_pipeline_machinery():
    """A fresh interpreter: importing the validator, then the config, then the parallel plan
    loads neither ``torch.distributed.pipelining`` nor the package's pipeline, cache,
    process-group or trainer modules; importing the pipeline module then does load its own (the
    check can see it)."""
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert loaded["validate"] == loaded["config"] == loaded["parallel_plan"] == []
    assert "attnres.train.pipeline" in loaded["pipeline"] and "attnres.train.stage_cache" in loaded["pipeline"]

"""compare.json as a typed record: what a comparison writes reads back and writes out unchanged,
key for key and in order, a key this version does not know included; a broken file is refused."""

import json

import pytest

from attnres.analysis.comparison_record import read_record, write_record

WRITTEN = {
    "complete": False, "designs": ["source", "convert:heads=2"], "seeds": [0, 1], "baseline": "source",
    "command": ["attnres", "compare", "--from", "m"], "steps": 8, "config": {"run": {"steps": 8}},
    "overrides": {}, "budgets": None,
    "runs": [{"design": "source", "seed": 0, "dir": "source-seed0", "options": {"design": "source"}, "steps": 8,
              "steps_done": 8},
             {"design": "convert:heads=2", "seed": 0, "dir": "convert+heads=2-seed0", "options": {"heads": 2},
              "steps": 8, "steps_done": 3}],
    "init_from": "/m", "shock_steps": 4, "downstream": {"tasks": ["t"], "complete": False},
    "machines": ["a1b2"], "wall_time_s": 12.5, "stopped_by": "SIGINT", "a_later_key": [1, 2],
}


def test_a_record_reads_back_and_writes_out_unchanged(tmp_path):
    (tmp_path / "compare.json").write_text(json.dumps(WRITTEN))
    record = read_record(tmp_path)
    assert record.init_from == "/m" and record.runs[1].steps_done == 3 and record.other == {"a_later_key": [1, 2]}
    assert [record.finished("source", 0), record.finished("convert:heads=2", 0), record.finished("source", 1)] == \
        [True, False, False]
    write_record(tmp_path, record)
    assert list(json.loads((tmp_path / "compare.json").read_text()).items()) == list(WRITTEN.items())


def test_a_recorded_run_replaces_its_earlier_entry(tmp_path):
    (tmp_path / "compare.json").write_text(json.dumps(WRITTEN))
    record = read_record(tmp_path)
    later = record.runs[1]
    later.steps_done = 8
    record.record(later)
    assert len(record.runs) == 2 and record.finished("convert:heads=2", 0)


@pytest.mark.parametrize("change,message", [
    ({"designs": []}, "'designs' is [], not a non-empty list of str"),
    ({"runs": [WRITTEN["runs"][0]] * 2}, "lists a design and seed twice"),
    ({"runs": [{**WRITTEN["runs"][0], "dir": "../x"}]}, "not the name of a folder"),
    ({"complete": "yes"}, "'complete' is 'yes'"),
])
def test_a_broken_record_is_refused_naming_the_file(tmp_path, change, message):
    (tmp_path / "compare.json").write_text(json.dumps({**WRITTEN, **change}))
    with pytest.raises(ValueError, match="compare.json") as err:
        read_record(tmp_path)
    assert message in str(err.value)

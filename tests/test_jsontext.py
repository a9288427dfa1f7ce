"""traceclf.support.jsontext: indented JSON with each row on one line, the same value as json.dumps."""

from __future__ import annotations

import json

from traceclf.support.jsontext import dumps


def test_rows_sit_on_one_line_and_the_value_is_unchanged() -> None:
    data = {
        "bound": "host",
        "series": [{"step": i, "ms": i * 1.5, "label": None} for i in range(3)],
        "window_ns": [10, 20],
        "empty": [],
        "nested": {"a": {"b": [1, [2, 3]]}},
    }
    text = dumps(data)
    assert json.loads(text) == data
    assert '    {"step": 1, "ms": 1.5, "label": null},' in text.splitlines()
    assert '  "window_ns": [10, 20],' in text.splitlines()
    assert json.loads(dumps(data, indent=None)) == data


def test_a_string_from_a_trace_cannot_pose_as_a_row() -> None:
    # A name shaped like the placeholder of an earlier encoder must come back as written.
    hostile = {"name": "\x00deadbeefdeadbeef:0", "rows": [{"a": 1}], "deep": {"x": ["\x00:0"]}}
    assert json.loads(dumps(hostile)) == hostile


def test_values_json_cannot_encode_go_through_default() -> None:
    class Odd:
        pass

    text = dumps({"row": [1, Odd()], "alone": Odd()}, default=lambda o: "odd")
    assert json.loads(text) == {"row": [1, "odd"], "alone": "odd"}

"""Pipes messages whose lines are written in pieces reach the handler whole (defs/platform/pipes_reader.py)."""

import json
import time

import dagster as dg

from vlm_assets.defs.platform.pipes_reader import WholeLineFileMessageReader, whole_lines
from vlm_assets_tests.waiting import wait_until


class Collected:
    """The two calls a Pipes reader thread makes on its session's message handler, recorded."""

    def __init__(self):
        self.messages, self.errors = [], []

    def handle_message(self, message):
        self.messages.append(message)

    def report_pipes_framework_exception(self, origin, exc_info):
        self.errors.append(f"{origin}: {exc_info[1]!r}")


def read_a_message_written_in_two_pieces(reader, path):
    """Write a long materialization message in two writes, the reader thread reading between them."""
    metadata = {"history": "x" * 20_000, "epochs": 6}
    line = json.dumps({"__dagster_pipes_version": "0.1", "method": "report_asset_materialization", "params": metadata})
    handler = Collected()
    with reader.read_messages(handler):
        with open(path, "a") as f:
            f.write(line[:100])
            f.flush()
            time.sleep(0.5)  # the reader polls every 10 ms: it reads the piece as a line of its own
            f.write(line[100:] + "\n")
        wait_until(lambda: handler.messages or handler.errors, "the reader to read the line", timeout=60, every=0.05)
    return handler, metadata


def test_a_message_written_in_pieces_is_read_whole(tmp_path):
    path = str(tmp_path / "messages")
    handler, metadata = read_a_message_written_in_two_pieces(WholeLineFileMessageReader(path), path)
    assert handler.errors == [] and [m["params"] for m in handler.messages] == [metadata]


def test_dagsters_own_reader_still_loses_it(tmp_path):
    """When this fails, Dagster's reader joins a line's pieces itself: remove pipes_reader.py and its use."""
    path = str(tmp_path / "messages")
    handler, _ = read_a_message_written_in_two_pieces(dg.PipesFileMessageReader(path), path)
    assert handler.messages == [] and "JSONDecodeError" in handler.errors[0]


def test_whole_lines_joins_pieces_up_to_each_newline():
    assert list(whole_lines(["a", "b\n", "c\n", "d"])) == ["ab\n", "c\n", "d"]

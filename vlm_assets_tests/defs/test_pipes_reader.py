"""Pipes messages whose lines are written in pieces reach the handler whole (defs/platform/pipes_reader.py)."""

import json

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


def read_a_message_written_in_two_pieces(reader, path, monkeypatch):
    """Write a long materialization message in two writes, the reader thread reading the first before the
    second is written (each module's ``tail_file`` wrapped to say what it read)."""
    from dagster._core.pipes import utils as dagster_pipes_utils
    from dagster._utils import tail_file

    from vlm_assets.defs.platform import pipes_reader

    pieces = []

    def recording_tail_file(*args, **kwargs):
        for piece in tail_file(*args, **kwargs):
            pieces.append(piece)
            yield piece

    for module in (pipes_reader, dagster_pipes_utils):
        monkeypatch.setattr(module, "tail_file", recording_tail_file)
    metadata = {"history": "x" * 20_000, "epochs": 6}
    line = json.dumps({"__dagster_pipes_version": "0.1", "method": "report_asset_materialization", "params": metadata})
    handler = Collected()
    with reader.read_messages(handler):
        with open(path, "a") as f:
            f.write(line[:100])
            f.flush()
            wait_until(lambda: pieces, "the reader to read the first piece", every=0.01)
            f.write(line[100:] + "\n")
        wait_until(lambda: handler.messages or handler.errors, "the reader to read the line", every=0.05)
    assert pieces[0] == line[:100]  # the first piece read as a line of its own
    return handler, metadata, pieces


def test_a_message_written_in_pieces_is_read_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "messages")
    handler, metadata, pieces = read_a_message_written_in_two_pieces(
        WholeLineFileMessageReader(path), path, monkeypatch
    )
    assert len(pieces) >= 2 and not pieces[0].endswith("\n")  # read in pieces, joined into one message
    assert handler.errors == [] and [m["params"] for m in handler.messages] == [metadata]


def test_dagsters_own_reader_still_loses_it(tmp_path, monkeypatch):
    """When this fails, Dagster's reader joins a line's pieces itself: remove pipes_reader.py and its use."""
    path = str(tmp_path / "messages")
    handler, _, _ = read_a_message_written_in_two_pieces(dg.PipesFileMessageReader(path), path, monkeypatch)
    assert handler.messages == [] and "JSONDecodeError" in handler.errors[0]


def test_whole_lines_joins_pieces_up_to_each_newline():
    assert list(whole_lines(["a", "b\n", "c\n", "d"])) == ["ab\n", "c\n", "d"]

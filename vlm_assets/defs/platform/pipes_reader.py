"""A Pipes message reader that parses a message only once its whole line has been written.

Dagster 1.13's ``PipesFileMessageReader`` tails the messages file with ``readline``, which at the end of
the file returns a partial line while the trainer's write of a long message (a materialization's
metadata) is still under way; ``json.loads`` fails on it, the reader thread ends and every later
report, the materialization included, is lost. The reader below joins the pieces up to the newline.
``vlm_assets_tests/defs/test_pipes_reader.py`` fails once Dagster's own reader does this, so that this
module can go.
"""

import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from threading import Event

import dagster as dg
from dagster._utils import tail_file


def whole_lines(pieces: Iterable[str]) -> Iterator[str]:
    """Yield the lines that ``pieces`` make up, each once its newline has come; a last line without one at the end."""
    partial = ""
    for piece in pieces:
        partial += piece
        if partial.endswith("\n"):
            yield partial
            partial = ""
    if partial:
        yield partial


class WholeLineFileMessageReader(dg.PipesFileMessageReader):
    """``dg.PipesFileMessageReader`` that reads each message from its whole line."""

    def _reader_thread(self, handler, is_resource_complete: Event) -> None:
        try:
            for line in whole_lines(tail_file(self._path, is_resource_complete.is_set)):
                handler.handle_message(json.loads(line))
        except:  # as Dagster's reader: the session reports the exception and the thread ends
            handler.report_pipes_framework_exception(f"{self.__class__.__name__} reader thread", sys.exc_info())
            raise


class WholeLineTempFileMessageReader(dg.PipesTempFileMessageReader):
    """``dg.PipesTempFileMessageReader`` whose file is read by ``WholeLineFileMessageReader``."""

    @contextmanager
    def read_messages(self, handler) -> Iterator[dict]:
        """Yield the Pipes params of a temporary messages file, read in a thread until the session closes."""
        with tempfile.TemporaryDirectory() as tempdir:
            path = os.path.join(tempdir, "messages")
            reader = WholeLineFileMessageReader(path, include_stdio_in_messages=self._include_stdio_in_messages)
            with reader.read_messages(handler) as params:
                yield params

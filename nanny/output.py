"""Which lines of a worker's output are its own log records (it ships those to Redis
itself) and which are not (prints, C extensions, faulthandler's dumps: the nanny ships
those).  Sans-I/O: lines in, a verdict out.

A record in the text format may run over several lines: ``logger.exception`` appends
the traceback.  Those lines belong to the record, which already carries its traceback,
so they are not shipped a second time as output.  Text cannot tell them from a traceback
that a task prints itself (``traceback.print_exc()``) right after a record of the text
format: that one is taken for the record's (the nanny's log file and the death record's
tail still have it).  The JSON format has no such doubt.
"""

from __future__ import annotations

import re

# a line that begins a log record (``utils.logs``): in the text format, whose traceback
# follows on the next lines, or a JSON line, which holds its own
TEXT_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
JSON_RECORD = re.compile(r'\{"time": ')
_CHAINED = ("During handling of the above exception", "The above exception was the direct")


class OutputLines:
    """Feed it each line in order; ``is_output`` says whether it is no part of a record."""

    def __init__(self) -> None:
        # "free": outside records; "record": just after a record or its traceback's last
        # line; "traceback": inside a traceback that follows a record
        self.state = "free"

    def is_output(self, line: str) -> bool:
        if TEXT_RECORD.match(line):
            self.state = "record"
            return False
        if JSON_RECORD.match(line):
            self.state = "free"
            return False
        if self.state == "free":
            return True
        if line.startswith("Traceback (most recent call last):") or line.startswith(_CHAINED):
            self.state = "traceback"
            return False
        if self.state == "traceback":
            if line[:1] in (" ", "\t") or not line.strip():
                return False
            self.state = "record"  # the exception's own line ends the traceback
            return False
        if not line.strip():  # a blank line between chained tracebacks
            return False
        self.state = "free"
        return True

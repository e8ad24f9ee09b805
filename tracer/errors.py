"""The one exception type the CLI turns into `error: ...` and exit code 2.

It lives in the lowest package so every subsystem can raise it without breaking the import order
(tracer -> costmodel -> planner -> executor -> soap).
"""


class SoapError(Exception):
    """Bad input or an impossible request. The message names the problem and the fix, on one line."""

"""IR op definitions: importing this package registers every op."""

from m3c.ir.ops import core, model  # noqa: F401

"""Hand-assembled pickles of the kind an attacker writes into a checkpoint or sends from a peer.

Each is a few dozen bytes that, loaded by a plain ``pickle.loads``, has a visible effect: it creates a
file (``io.FileIO(path, "w")`` creates it before the loader even looks at the result), runs a shell
command, or spawns a process. The tests assert that elastrain's loaders never let any of them happen.
"""

from __future__ import annotations

DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"

PROTO4 = b"\x80\x04"
MARK, TUPLE, TUPLE1, REDUCE, STOP = b"(", b"t", b"\x85", b"R", b"."
EMPTY_LIST, APPENDS, MEMOIZE, STACK_GLOBAL = b"]", b"e", b"\x94", b"\x93"


def text(s: str) -> bytes:
    """A str on the stack (SHORT_BINUNICODE or BINUNICODE)."""
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) if len(b) < 256 else b"X" + len(b).to_bytes(4, "little")) + b


def stack_global(module: str, name: str) -> bytes:
    """Protocol 4's lookup: ``find_class(module, name)``, where ``name`` may be dotted."""
    return text(module) + text(name) + STACK_GLOBAL


def text_global(module: str, name: str) -> bytes:
    """Protocol 0-2's lookup, the GLOBAL opcode."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def call(callable_ops: bytes, *args: str) -> bytes:
    """``callable(*args)`` with string arguments (REDUCE)."""
    return callable_ops + MARK + b"".join(text(a) for a in args) + TUPLE + REDUCE


def call_with_list(callable_ops: bytes, *items: str) -> bytes:
    """``callable([items...])`` (REDUCE): how ``subprocess.Popen(argv)`` is called."""
    return callable_ops + EMPTY_LIST + MARK + b"".join(text(a) for a in items) + APPENDS + TUPLE1 + REDUCE


def pickle4(body: bytes) -> bytes:
    return PROTO4 + body + STOP


def creates_file(path: str, module: str = DCP_FILESYSTEM, name: str = "io.FileIO") -> bytes:
    """A dotted name through a module DCP's own metadata imports, reaching a class that creates ``path``."""
    return pickle4(call(stack_global(module, name), path, "w"))


def spawns(argv: list[str], module: str = DCP_METADATA) -> bytes:
    """The review's payload: ``subprocess.Popen(argv)`` reached through torch modules the DCP module imports."""
    return pickle4(
        call_with_list(stack_global(module, "torch._strobelight.cli_function_profiler.subprocess.Popen"), *argv)
    )


def runs(command: str, module: str, name: str, stack: bool = True) -> bytes:
    """``module.name(command)``: ``os.system``, ``builtins.eval`` and their kind."""
    lookup = stack_global(module, name) if stack else text_global(module, name)
    return pickle4(call(lookup, command))


def computed_name(path: str) -> bytes:
    """STACK_GLOBAL on names built on the stack from the memo (BINGET), not written next to the opcode."""
    module = text(DCP_FILESYSTEM) + MEMOIZE  # memo 0
    name = text("io.FileIO") + MEMOIZE  # memo 1
    pop2 = b"00"
    fetch = b"h\x00h\x01"
    return pickle4(module + name + pop2 + fetch + STACK_GLOBAL + MARK + text(path) + text("w") + TUPLE + REDUCE)


def inst(path: str) -> bytes:
    """Protocol 0's INST opcode: ``find_class`` then a call, without REDUCE."""
    return MARK + text(path) + text("w") + b"i" + DCP_FILESYSTEM.encode() + b"\nio.FileIO\n" + STOP


def persistent(pid: str) -> bytes:
    """A persistent id (PERSID): what ``torch.load``'s storages use; DCP metadata never has one."""
    return b"P" + pid.encode() + b"\n" + STOP

"""Kernel parameter ABI: parse PTX entry signatures and pack launch arguments.

Pure Python (no CUDA import), shared by the driver (``ptxgen.driver``) and
the CPU emulator. The flow is::

    params = parse_entries(ptx_text)["vadd"]      # list[ParamInfo]
    packer = ArgPacker("vadd", params)            # checks + struct layout
    blob = packer.pack((a, b, c, n))              # little-endian param buffer
    args = packer.order({"n": n, "a": a, "b": b, "c": c})   # by name -> (a, b, c, n)

Pointer-sized integer parameters (``.u64``/``.s64``/``.b64``, and any
``.ptr`` parameter) accept an ``int`` address, any object exposing
``__cuda_array_interface__`` (``data[0]`` is taken), or any object with an
integer ``.ptr`` attribute (driver ``DeviceArray``, emulator buffers). An
object whose ``freed`` attribute is true is refused. Every refusal is a
:class:`LaunchArgumentError` naming the kernel, the parameter, its position,
what was expected and what was given; arguments given by name that miss a
parameter or name one the kernel lacks are refused the same way.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import struct
from dataclasses import dataclass

__all__ = [
    "ArgPacker",
    "LaunchArgumentError",
    "PTXSignatureError",
    "ParamInfo",
    "pack_args",
    "param_layout",
    "parse_entries",
    "pointer_address",
    "register_pointer_type",
    "to_bytes",
]


class LaunchArgumentError(ValueError):
    """A kernel argument does not fit the kernel's declared parameter."""


class PTXSignatureError(ValueError):
    """A ``.entry`` signature could not be parsed."""


# ptx type -> (struct code, size in bytes, kind); kind is "u", "s", "b", "f", "bf"
_TYPES: dict[str, tuple[str, int, str]] = {
    "u8": ("B", 1, "u"), "u16": ("H", 2, "u"), "u32": ("I", 4, "u"), "u64": ("Q", 8, "u"),
    "s8": ("b", 1, "s"), "s16": ("h", 2, "s"), "s32": ("i", 4, "s"), "s64": ("q", 8, "s"),
    "b8": ("B", 1, "b"), "b16": ("H", 2, "b"), "b32": ("I", 4, "b"), "b64": ("Q", 8, "b"),
    "f16": ("e", 2, "f"), "f32": ("f", 4, "f"), "f64": ("d", 8, "f"),
    "bf16": ("H", 2, "bf"),
}
_STATE_SPACES = ("global", "shared", "const", "local")
_F32_MAX = 3.4028234663852886e38


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One kernel parameter as declared in the PTX signature.

    Attributes
    ----------
    name : str
        Parameter name (``n`` in ``.param .u32 n``).
    type : str
        PTX type without the dot: ``"u64"``, ``"u32"``, ``"s32"``, ``"f32"``, ``"b8"``...
    size : int
        Size in bytes (element size times ``count``).
    is_pointer : bool
        True when declared with ``.ptr``.
    index : int
        0-based position in the parameter list.
    align : int
        Alignment in the parameter buffer (``.align N`` or the natural size).
    count : int
        Element count; 1 for a scalar, N for ``name[N]`` (a by-value aggregate).
    state_space : str or None
        ``"global"``/``"shared"``/... for ``.ptr`` params that name one.
    """

    name: str
    type: str
    size: int
    is_pointer: bool = False
    index: int = 0
    align: int = 0
    count: int = 1
    state_space: str | None = None

    @property
    def accepts_address(self) -> bool:
        """True when the parameter can take a device pointer (64-bit int or ``.ptr``)."""
        return self.is_pointer or (self.count == 1 and self.type in ("u64", "s64", "b64"))

    def describe(self) -> str:
        """The declaration as PTX spells it, e.g. ``.param .u64 .ptr .global a``."""
        parts = [".param"]
        if self.count > 1:
            parts += [f".align {self.align}", f".{self.type}", f"{self.name}[{self.count}]"]
            return " ".join(parts)
        parts.append(f".{self.type}")
        if self.is_pointer:
            parts.append(".ptr")
            if self.state_space:
                parts.append(f".{self.state_space}")
        parts.append(self.name)
        return " ".join(parts)


# ----------------------------------------------------------------------------- parsing

_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_ENTRY_RE = re.compile(
    r"(?:^|[\s;}])\.entry\s+([A-Za-z_$%][\w$]*)\s*(\((?P<params>[^)]*)\))?", re.S
)
_ARRAY_RE = re.compile(r"^([A-Za-z_$%][\w$]*)\s*\[\s*(\d+)\s*\]$")
_NAME_RE = re.compile(r"^[A-Za-z_$%][\w$]*$")


def _strip_comments(text: str) -> str:
    # keep line structure so nothing downstream mis-counts lines
    return _COMMENT_RE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _parse_param(decl: str, index: int, entry: str) -> ParamInfo:
    text = decl.strip()
    # "name [ 16 ]" -> "name[16]" so tokens split cleanly
    text = re.sub(r"\s*\[\s*(\d+)\s*\]", r"[\1]", text)
    tokens = text.split()
    if not tokens or tokens[0] != ".param":
        raise PTXSignatureError(f"entry {entry}: parameter {index} is not a .param: {decl.strip()!r}")
    ptype = None
    is_ptr = False
    align = 0
    space = None
    i = 1
    while i < len(tokens) - 1:
        tok = tokens[i]
        if tok == ".align":
            try:
                align = int(tokens[i + 1])
            except (IndexError, ValueError):
                raise PTXSignatureError(f"entry {entry}: bad .align in {decl.strip()!r}") from None
            i += 2
            continue
        if tok == ".ptr":
            is_ptr = True
        elif tok.startswith(".") and tok[1:] in _STATE_SPACES:
            space = tok[1:]
        elif tok.startswith(".") and tok[1:] in _TYPES:
            ptype = tok[1:]
        else:
            raise PTXSignatureError(f"entry {entry}: unknown qualifier {tok!r} in {decl.strip()!r}")
        i += 1
    if ptype is None or i != len(tokens) - 1:
        raise PTXSignatureError(f"entry {entry}: cannot parse parameter {decl.strip()!r}")
    last = tokens[-1]
    count = 1
    m = _ARRAY_RE.match(last)
    if m:
        name, count = m.group(1), int(m.group(2))
    elif _NAME_RE.match(last):
        name = last
    else:
        raise PTXSignatureError(f"entry {entry}: bad parameter name {last!r}")
    elem = _TYPES[ptype][1]
    return ParamInfo(
        name=name,
        type=ptype,
        size=elem * count,
        is_pointer=is_ptr,
        index=index,
        align=align or elem,
        count=count,
        state_space=space,
    )


def parse_entries(ptx_text: str) -> dict[str, list[ParamInfo]]:
    """Parse every ``.entry`` signature of a PTX module.

    Parameters
    ----------
    ptx_text : str
        PTX source text.

    Returns
    -------
    dict[str, list[ParamInfo]]
        Kernel name to its parameters, in declaration order. Entries without a
        parameter list map to an empty list.

    Raises
    ------
    PTXSignatureError
        When a parameter declaration cannot be understood.
    """
    text = _strip_comments(ptx_text)
    entries: dict[str, list[ParamInfo]] = {}
    for m in _ENTRY_RE.finditer(text):
        name = m.group(1)
        body = m.group("params")
        params: list[ParamInfo] = []
        if body is not None and body.strip():
            for i, decl in enumerate(body.split(",")):
                params.append(_parse_param(decl, i, name))
        entries[name] = params
    return entries


def param_layout(params: list[ParamInfo] | tuple[ParamInfo, ...]) -> tuple[list[int], int]:
    """Byte offsets of each parameter in a packed parameter buffer, and its size.

    Each parameter starts at a multiple of its alignment, as in CUDA's kernel
    parameter space; the total is rounded up to 8 bytes.
    """
    offsets = []
    off = 0
    for p in params:
        a = max(p.align, 1)
        off = (off + a - 1) // a * a
        offsets.append(off)
        off += p.size
    return offsets, (off + 7) // 8 * 8


# ----------------------------------------------------------------------------- conversion


class _Refused(Exception):
    """Internal: carries (expected, given) up to the packer, which adds names."""

    def __init__(self, expected: str, given: str):
        super().__init__(expected, given)
        self.expected = expected
        self.given = given


def _type_name(v) -> str:
    t = type(v)
    mod = t.__module__
    return t.__qualname__ if mod == "builtins" else f"{mod.split('.')[0]}.{t.__qualname__}"


def _describe(v) -> str:
    name = _type_name(v)
    if isinstance(v, (bool, int, float)):
        return f"{name} {v!r}"
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"{name} of shape {tuple(v.shape)} and dtype {v.dtype}"
    return name


def _is_array_like(v) -> bool:
    if isinstance(v, (bytes, bytearray, memoryview, str)):
        return False
    if hasattr(v, "__cuda_array_interface__") or hasattr(v, "ptr"):
        return True
    if getattr(v, "ndim", None) == 0:  # numpy scalars and 0-d host arrays
        return False
    return hasattr(v, "__array_interface__") or hasattr(v, "__len__")


def pointer_address(value) -> int:
    """Device address of an int, a ``__cuda_array_interface__`` object or a ``.ptr`` object.

    Raises
    ------
    LaunchArgumentError
        (through the caller) when ``value`` is none of those, or is freed.
    """
    if type(value) is int:
        if 0 <= value < 1 << 64:
            return value
        raise _Refused("a 64-bit device address (0 <= address < 2**64)", f"int {value}")
    if isinstance(value, bool):
        raise _Refused("a device pointer", f"bool {value!r}")
    if getattr(value, "freed", False) is True:
        raise _Refused("a live device array", f"a {_type_name(value)} that was already freed")
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        try:
            addr = int(cai["data"][0])
        except (KeyError, TypeError, IndexError, ValueError):
            raise _Refused("a valid __cuda_array_interface__ with data=(ptr, readonly)",
                           f"{_type_name(value)} with interface {cai!r}") from None
        return addr
    if hasattr(value, "ptr"):
        try:
            addr = operator.index(value.ptr)
        except TypeError:
            raise _Refused("an object whose .ptr is an integer address",
                           f"{_type_name(value)} with .ptr of type {_type_name(value.ptr)}") from None
        except Exception as exc:  # a .ptr property that refuses (e.g. freed buffer)
            raise _Refused("a live device buffer", f"{_type_name(value)}: {exc}") from None
        if not 0 <= addr < 1 << 64:
            raise _Refused("a 64-bit device address", f"{_type_name(value)} with .ptr {addr}")
        return addr
    if hasattr(value, "__index__") and not isinstance(value, float):
        try:
            return pointer_address(operator.index(value))  # numpy integer scalars
        except TypeError:
            pass
    given = _describe(value)
    if hasattr(value, "__array_interface__") or hasattr(value, "__array__"):
        given += " (host memory: copy it to the device first, e.g. DeviceArray.from_numpy)"
    raise _Refused(
        "a device pointer (int address, DeviceArray, or an object with "
        "__cuda_array_interface__ or an integer .ptr)",
        given,
    )


def _int_bounds(p: ParamInfo) -> tuple[int, int]:
    bits = _TYPES[p.type][1] * 8
    kind = _TYPES[p.type][2]
    if kind == "u":
        return 0, (1 << bits) - 1
    if kind == "s":
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return -(1 << (bits - 1)), (1 << bits) - 1  # untyped bits: either reading


def _make_int_conv(p: ParamInfo):
    lo, hi = _int_bounds(p)
    kind = _TYPES[p.type][2]
    mask = (1 << (p.size * 8)) - 1 if kind == "b" else -1
    address_ok = p.accepts_address
    spelled = f".{p.type}"

    def slow(v):
        if isinstance(v, bool):
            return slow(int(v))
        if type(v) is not int:
            if address_ok and (
                hasattr(v, "__cuda_array_interface__") or hasattr(v, "ptr") or hasattr(v, "freed")
            ):
                return pointer_address(v)
            if isinstance(v, float) or (hasattr(v, "dtype") and getattr(v.dtype, "kind", "") == "f"
                                        and getattr(v, "ndim", 0) == 0):
                raise _Refused(f"an integer for {spelled} (no implicit float truncation)", _describe(v))
            if _is_array_like(v):
                if address_ok:
                    return pointer_address(v)
                raise _Refused(f"a scalar integer for {spelled}", f"an array-like {_describe(v)}")
            try:
                v = operator.index(v)
            except TypeError:
                raise _Refused(f"an integer for {spelled}", _describe(v)) from None
        if not lo <= v <= hi:
            raise _Refused(f"an integer in [{lo}, {hi}] for {spelled}", f"{v} (out of range)")
        return v & mask if v < 0 and mask != -1 else v

    if mask == -1:
        def conv(v):
            if type(v) is int and lo <= v <= hi:
                return v
            return slow(v)
    else:
        def conv(v):
            if type(v) is int and 0 <= v <= hi:
                return v
            return slow(v)
    return conv


def _bf16_bits(x: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if x != x:
        return 0x7FC0
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _make_float_conv(p: ParamInfo):
    code = _TYPES[p.type][0]
    kind = _TYPES[p.type][2]
    spelled = f".{p.type}"
    fmax = {"e": 65504.0, "f": _F32_MAX, "d": math.inf}.get(code, _F32_MAX)

    def slow(v):
        if isinstance(v, bool):
            raise _Refused(f"a float for {spelled}", _describe(v))
        if type(v) not in (int, float):
            if _is_array_like(v):
                raise _Refused(f"a scalar float for {spelled}", f"an array-like {_describe(v)}")
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise _Refused(f"a float for {spelled}", _describe(v)) from None
        try:
            x = float(v)
        except OverflowError:
            raise _Refused(f"a float within {spelled} range", f"{v} (out of range)") from None
        if math.isfinite(x) and abs(x) > fmax:
            try:
                struct.pack("<" + code, x)  # values that round to the max are fine
            except (OverflowError, struct.error):
                raise _Refused(f"a float within {spelled} range (|x| <= {fmax:g})",
                               f"{v!r} (out of range)") from None
        return _bf16_bits(x) if kind == "bf" else x

    if kind == "bf":
        return slow

    def conv(v):
        if type(v) is float and -fmax <= v <= fmax:
            return v
        return slow(v)
    return conv


def _make_bytes_conv(p: ParamInfo):
    def conv(v):
        if isinstance(v, (bytes, bytearray, memoryview)) or hasattr(v, "tobytes"):
            data = bytes(v) if not hasattr(v, "tobytes") else v.tobytes()
            if len(data) == p.size:
                return data
            raise _Refused(f"{p.size} bytes for .{p.type}[{p.count}]", f"{len(data)} bytes")
        given = _describe(v)
        if hasattr(v, "emu_bytes"):
            given += (" (an emulator tensor-map description: on a GPU pass "
                      "ptxgen.driver.tensor_map.encode_tiled(map))")
        raise _Refused(f"a bytes-like object of {p.size} bytes for .{p.type}[{p.count}]", given)
    return conv


def _make_conv(p: ParamInfo):
    if p.count > 1:
        return _make_bytes_conv(p)
    kind = _TYPES[p.type][2]
    if p.is_pointer:
        def conv(v):
            if type(v) is int and 0 <= v < 1 << 64:
                return v
            return pointer_address(v)
        return conv
    if kind in ("u", "s", "b"):
        return _make_int_conv(p)
    return _make_float_conv(p)


def _struct_code(p: ParamInfo) -> str:
    if p.count > 1:
        return f"{p.size}s"
    return _TYPES[p.type][0]


# ----------------------------------------------------------------------------- packer


_POINTER_GETTERS: dict = {}


def register_pointer_type(cls: type, getter) -> None:
    """Give :class:`ArgPacker` a fast path for a device-buffer type.

    Parameters
    ----------
    cls : type
        Exact type of the buffer objects (subclasses are not matched).
    getter : callable
        ``getter(obj) -> int`` returning the device address, or 0 when the
        object cannot be used (freed): 0 sends the object down the checked
        path, which produces the error message.
    """
    _POINTER_GETTERS[cls] = getter


def _fast_check(p: ParamInfo, v: str) -> tuple[str, bool] | None:
    """Source of a condition that accepts ``v`` unchanged, and whether the
    registered pointer getters apply; None when every value takes the checked path."""
    if p.count > 1:
        return None
    kind = _TYPES[p.type][2]
    if p.is_pointer:
        return f"type({v}) is int and 0 <= {v} <= {(1 << 64) - 1}", True
    if kind in ("u", "s", "b"):
        lo, hi = _int_bounds(p)
        lo = max(lo, 0) if kind == "b" else lo  # negative untyped bits need masking
        return f"type({v}) is int and {lo} <= {v} <= {hi}", p.accepts_address
    if kind == "f":
        fmax = {"f16": 65504.0, "f32": _F32_MAX}.get(p.type)
        if fmax is None:
            return f"type({v}) is float", False
        return f"type({v}) is float and {-fmax!r} <= {v} <= {fmax!r}", False
    return None


@functools.lru_cache(maxsize=4096)
def _compile_checks(source: str, kernel_name: str):
    """Compiled code of a generated checker (compiling costs far more than running it)."""
    return compile(source, f"<ptxgen.abi checks for {kernel_name}>", "exec")


class ArgPacker:
    """Checks and packs launch arguments for one kernel signature.

    The per-argument checks are generated once per signature as straight-line
    Python (see :attr:`source`): common values (ints in range, floats, device
    buffers of a registered type) pass with one comparison, anything else goes
    through the full conversion, which raises the descriptive error.

    Parameters
    ----------
    kernel_name : str
        Used in error messages.
    params : sequence of ParamInfo
        The kernel's parameters, in order.

    Attributes
    ----------
    offsets : list[int]
        Byte offset of each parameter in the packed buffer.
    size : int
        Size of the packed buffer in bytes.
    source : str
        The generated source of :meth:`values` (and of the packing fast path).
    """

    __slots__ = ("kernel_name", "params", "offsets", "size", "source", "values", "_pack_into",
                 "_struct", "_convs", "_n", "_names")

    def __init__(self, kernel_name: str, params):
        self.kernel_name = kernel_name
        self.params = tuple(params)
        self.offsets, self.size = param_layout(self.params)
        fmt = ["<"]
        pos = 0
        for p, off in zip(self.params, self.offsets):
            if off > pos:
                fmt.append(f"{off - pos}x")
            fmt.append(_struct_code(p))
            pos = off + p.size
        if self.size > pos:
            fmt.append(f"{self.size - pos}x")
        self._struct = struct.Struct("".join(fmt))
        self._convs = tuple(_make_conv(p) for p in self.params)
        self._n = len(self.params)
        self._names = tuple(p.name for p in self.params)
        self.source = self._generate()
        namespace = {"getters": _POINTER_GETTERS, "slow": self._slow, "count_error": self._count_error,
                     "struct_pack_into": self._struct.pack_into}
        exec(_compile_checks(self.source, kernel_name), namespace)
        self.values = namespace["values"]
        self._pack_into = namespace["pack_into"]

    def _generate(self) -> str:
        checks = self._generate_checks()
        names = ", ".join(f"a{i}" for i in range(self._n))
        values = [
            "def values(args):",
            '    """Check args; return the converted values (raises LaunchArgumentError)."""',
            *checks,
            f"    return ({names}{',' if self._n == 1 else ''})",
        ]
        pack = [
            "def pack_into(buffer, args):",
            '    """Check args and pack them into buffer at offset 0."""',
            *checks,
            f"    struct_pack_into(buffer, 0{', ' if names else ''}{names})",
        ]
        return "\n".join(values) + "\n\n\n" + "\n".join(pack) + "\n"

    def _generate_checks(self) -> list[str]:
        n = self._n
        names = [f"a{i}" for i in range(n)]
        lines = [
            f"    if len(args) != {n}:",
            "        count_error(len(args))",
        ]
        if n:
            lines.append(f"    {', '.join(names)}, = args")
        for i, (p, v) in enumerate(zip(self.params, names)):
            fast = _fast_check(p, v)
            if fast is None:
                lines.append(f"    {v} = slow({i}, {v})")
                continue
            cond, pointers = fast
            lines.append(f"    if not ({cond}):")
            if pointers:
                lines.append(f"        g = getters.get(type({v}))")
                lines.append(f"        {v} = (g({v}) if g is not None else 0) or slow({i}, {v})")
            else:
                lines.append(f"        {v} = slow({i}, {v})")
        return lines

    def signature(self) -> str:
        """``name(.u64 .ptr a, .u32 n)`` for messages."""
        inner = ", ".join(
            f".{p.type}{' .ptr' if p.is_pointer else ''} {p.name}" + (f"[{p.count}]" if p.count > 1 else "")
            for p in self.params
        )
        return f"{self.kernel_name}({inner})"

    def _count_error(self, given: int):
        raise LaunchArgumentError(
            f"{self.kernel_name}() takes {self._n} argument{'s' if self._n != 1 else ''}, "
            f"as declared in {self.signature()}, but {given} "
            f"{'was' if given == 1 else 'were'} given"
        )

    def _slow(self, i: int, value):
        try:
            return self._convs[i](value)
        except _Refused as r:
            p = self.params[i]
            raise LaunchArgumentError(
                f"{self.kernel_name}(): parameter '{p.name}' (position {i} of {self._n}, "
                f"{p.describe()}) expected {r.expected}, got {r.given}"
            ) from None

    def order(self, named) -> tuple:
        """The arguments given by parameter name (a mapping), as a tuple in
        declaration order (their values are checked when packed).

        Raises
        ------
        LaunchArgumentError
            A parameter without an argument, or an argument whose name is
            no parameter of the kernel.
        """
        if len(named) == self._n:
            try:
                return tuple([named[n] for n in self._names])
            except KeyError:
                pass
        self._order_error(named)

    def _order_error(self, named):
        names = set(self._names)
        extra = [n for n in named if n not in names]
        missing = [p for p in self.params if p.name not in named]
        if extra:
            near = [n for n in self._names if n not in named]
            raise LaunchArgumentError(
                f"{self.kernel_name}(): no parameter named {extra[0]!r}"
                + (f" (of {len(extra)} unknown names: {', '.join(map(repr, extra))})"
                   if len(extra) > 1 else "")
                + f"; its parameters are {self.signature()}"
                + (f", and {', '.join(map(repr, near))} {'has' if len(near) == 1 else 'have'} "
                   f"no argument" if near else ""))
        p = missing[0]
        raise LaunchArgumentError(
            f"{self.kernel_name}(): parameter '{p.name}' (position {p.index} of {self._n}, "
            f"{p.describe()}) has no argument"
            + (f", nor do {', '.join(repr(q.name) for q in missing[1:])}" if len(missing) > 1
               else ""))

    def pack_into(self, buffer, args, offset: int = 0) -> None:
        """Check ``args`` and write the packed parameter buffer into ``buffer``."""
        if offset:
            self._struct.pack_into(buffer, offset, *self.values(args))
        else:
            self._pack_into(buffer, args)

    def pack(self, args) -> bytes:
        """Check ``args`` and return the packed little-endian parameter buffer."""
        return self._struct.pack(*self.values(args))


def pack_args(params, args, kernel_name: str) -> list[tuple[ParamInfo, object]]:
    """Check ``args`` against ``params`` and pair each parameter with its converted value.

    Parameters
    ----------
    params : sequence of ParamInfo
        From :func:`parse_entries`.
    args : sequence
        The caller's arguments.
    kernel_name : str
        Named in error messages.

    Returns
    -------
    list of (ParamInfo, value)
        ``value`` is an ``int`` for integer and pointer parameters (the address
        for arrays; negative ``.b`` values already reduced modulo 2**bits), a
        ``float`` for ``.f16/.f32/.f64``, the bf16 bit pattern (int) for
        ``.bf16``, and ``bytes`` for ``name[N]`` aggregates.

    Raises
    ------
    LaunchArgumentError
        Wrong count, wrong kind (array vs scalar, int vs float), out-of-range
        integer or float, or a freed array.
    """
    packer = ArgPacker(kernel_name, params)
    return list(zip(packer.params, packer.values(tuple(args))))


def to_bytes(param: ParamInfo, value) -> bytes:
    """Little-endian bytes of one converted value (as returned by :func:`pack_args`)."""
    return struct.pack("<" + _struct_code(param), value)

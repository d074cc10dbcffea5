"""Matmul and convolution FLOPs of an XLA-compiled TF function, counted from its optimized HLO.

TF does not expose XLA's cost analysis in Python, so this reads the optimized HLO text
(`tf.function.experimental_get_compiler_ir`) and counts

- `dot`: 2 · (elements of the result) · (product of the contracted dimensions),
- `convolution`: 2 · batch · output features · input features per group · the number of
  (output position, kernel tap) pairs that land on a real input element, per spatial dimension
  (padding and the holes of a dilated input, i.e. transposed convolutions, do not count),

inside fusions and calls, and multiplies whatever runs inside a `while` body by its trip count:
XLA's `known_trip_count` where it annotates one, else the count worked out from the loop
condition `i < bound` with the initial `i` and `bound` traced back to constants or to the final
counter of another loop (TF's gradient loops run as often as their forward loop; step 1 assumed).
Elementwise work is not counted: the number is meant to be compared with a matmul peak.
"""

import math
import re
from dataclasses import dataclass, field

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY_SHAPE = re.compile(r"^[a-z]+[0-9]*\[([0-9,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")  # a predicated conditional
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_INDUCTION = re.compile(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"(\d+)"')
_INIT_STEP = re.compile(
    r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"(-?\d+)"\s*,'
    r'\s*"step"\s*:\s*"(-?\d+)"'
)


@dataclass
class Instruction:
    name: str
    shape: str  # the HLO shape text, e.g. "f32[16,64]{1,0}" or a tuple "(s32[], ...)"
    opcode: str
    operands: list  # operand instruction names (same computation)
    attrs: str  # everything after the operand list
    args: str  # the raw operand text (holds the literal of a `constant`)


@dataclass
class FlopCount:
    """FLOPs of one call of the compiled function."""

    total: int = 0
    dot: int = 0
    convolution: int = 0
    loops: list = field(default_factory=list)  # (op_name, trip count or None) per while
    unresolved_loops: list = field(default_factory=list)  # counted once: trip count unknown
    custom_calls: list = field(default_factory=list)  # targets not counted (e.g. oneDNN)

    @property
    def exact(self):
        """True when every loop's trip count was known and no custom call was skipped."""
        return not self.unresolved_loops and not self.custom_calls


def _split_balanced(text, start):
    """Index just past the bracket group that opens at `text[start]`."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[text[start]]]
    i = start + 1
    while stack:
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif c == stack[-1]:
            stack.pop()
        i += 1
    return i


def _parse_instruction(line):
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(2), m.group(3)
    if rest.startswith("("):  # tuple shape
        end = _split_balanced(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    m = re.match(r"([a-z][\w\-]*)\(", rest)
    if not m:
        return None
    opcode = m.group(1)
    close = _split_balanced(rest, m.end() - 1)
    args = rest[m.end() : close - 1]
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instruction(name, shape, opcode, operands, rest[close:], args)


class Computation(dict):
    """Instruction name -> :class:`Instruction`, in text order; `root` names the result."""

    root = None


def parse_hlo(hlo_text):
    """`(computations, entry name)`: every computation of an HLO module by name."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = computations[m.group(2)] = Computation()
                if m.group(1):
                    entry = m.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instruction(line)
        if instr is not None:
            current[instr.name] = instr
            if line.lstrip().startswith("ROOT"):
                current.root = instr.name
    return computations, entry


def _dims(shape):
    m = _ARRAY_SHAPE.match(shape)
    if not m:
        raise ValueError(f"not an array shape: {shape!r}")
    return [int(d) for d in m.group(1).split(",") if d]


def _attr(attrs, key):
    m = re.search(rf"\b{key}=([^,\s]+)", attrs)
    return m.group(1) if m else None


def dot_flops(instr, comp):
    lhs = _dims(comp[instr.operands[0]].shape)
    contracting = _attr(instr.attrs, "lhs_contracting_dims") or "{}"
    k = math.prod(lhs[int(i)] for i in contracting.strip("{}").split(",") if i)
    return 2 * math.prod(_dims(instr.shape)) * k


def _window(attrs):
    """Per spatial dimension: size, stride, (pad_lo, pad_hi), lhs dilation, rhs dilation."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(f.split("=") for f in m.group(1).split()) if m else {}
    size = [int(s) for s in fields["size"].split("x")] if "size" in fields else []

    def per_dim(key, default):
        return [v for v in fields[key].split("x")] if key in fields else [default] * len(size)

    stride = [int(s) for s in per_dim("stride", "1")]
    pad = [tuple(int(p) for p in s.split("_")) for s in per_dim("pad", "0_0")]
    lhs_dilate = [int(s) for s in per_dim("lhs_dilate", "1")]
    rhs_dilate = [int(s) for s in per_dim("rhs_dilate", "1")]
    return size, stride, pad, lhs_dilate, rhs_dilate


def _valid_taps(in_size, out_size, kernel, stride, pad_lo, lhs_dilate, rhs_dilate):
    """(output position, kernel tap) pairs that read a real (not padded, not hole) input."""
    dilated = (in_size - 1) * lhs_dilate + 1
    count = 0
    for o in range(out_size):
        for k in range(kernel):
            pos = o * stride + k * rhs_dilate - pad_lo
            if 0 <= pos < dilated and pos % lhs_dilate == 0:
                count += 1
    return count


def convolution_flops(instr, comp):
    labels = _attr(instr.attrs, "dim_labels")  # e.g. b01f_01io->b01f
    lhs_labels, rest = labels.split("_", 1)
    rhs_labels, out_labels = rest.split("->")
    lhs = _dims(comp[instr.operands[0]].shape)
    rhs = _dims(comp[instr.operands[1]].shape)
    out = _dims(instr.shape)
    size, stride, pad, lhs_dilate, rhs_dilate = _window(instr.attrs)
    taps = 1
    for d in range(len(size)):
        spatial = str(d)
        taps *= _valid_taps(
            lhs[lhs_labels.index(spatial)],
            out[out_labels.index(spatial)],
            rhs[rhs_labels.index(spatial)],
            stride[d],
            pad[d][0],
            lhs_dilate[d],
            rhs_dilate[d],
        )
    batch = out[out_labels.index("b")]
    out_features = out[out_labels.index("f")]
    in_features_per_group = rhs[rhs_labels.index("i")]
    batch_groups = int(_attr(instr.attrs, "batch_group_count") or 1)
    return 2 * (batch // batch_groups) * out_features * in_features_per_group * taps


class _Counter:
    def __init__(self, computations):
        self.computations = computations
        self.memo = {}
        self.result = FlopCount()

    # --- scalar integers the loop bounds are made of -----------------------------------------
    def int_value(self, comp, name, depth=0):
        """The value of scalar integer `name` in `comp`, or None if it is not static."""
        instr = comp.get(name)
        if instr is None or depth > 20:
            return None
        if instr.opcode == "constant":
            m = re.fullmatch(r"\s*(-?\d+)\s*", instr.args)
            return int(m.group(1)) if m else None
        if instr.opcode in ("copy", "convert", "bitcast", "reshape"):
            return self.int_value(comp, instr.operands[0], depth + 1)
        if instr.opcode == "get-tuple-element":
            index = int(_attr(instr.attrs, "index"))
            source = comp.get(instr.operands[0])
            if source is None:
                return None
            if source.opcode == "tuple":
                return self.int_value(comp, source.operands[index], depth + 1)
            if source.opcode == "while":
                return self.final_counter(comp, source, index, depth)
        return None

    def final_counter(self, comp, loop, index, depth):
        """The value of tuple element `index` of `loop` after it ends, if it is the counter."""
        induction = _INDUCTION.search(loop.attrs)
        trip = self.trip_count(comp, loop, depth + 1)
        if trip is None:
            return None
        if induction and int(induction.group(1)) == index:
            init_step = _INIT_STEP.search(loop.attrs)
            if init_step:
                return int(init_step.group(1)) + trip * int(init_step.group(2))
        counter = self.loop_counter(loop)
        if counter is not None and counter[0] == index:
            init = self.int_value(comp, self.loop_init(comp, loop, index), depth + 1)
            return None if init is None else init + trip
        return None

    @staticmethod
    def loop_init(comp, loop, index):
        init = comp[loop.operands[0]]
        return init.operands[index] if init.opcode == "tuple" else None

    def loop_counter(self, loop):
        """`(counter index, bound index or None, bound constant or None, direction)` from the
        loop condition `counter <direction> bound`, or None."""
        cond = self.computations[_attr(loop.attrs, "condition").lstrip("%")]
        root = cond[cond.root]
        operands, compare = root.operands, root
        if root.opcode == "fusion":  # XLA wraps the compare: map the fused parameters back
            fused = self.computations[_attr(root.attrs, "calls").lstrip("%")]
            compare = fused[fused.root]
            params = {i.name: int(i.args) for i in fused.values() if i.opcode == "parameter"}
            if compare.opcode != "compare" or not all(o in params for o in compare.operands):
                return None
            operands = [root.operands[params[o]] for o in compare.operands]
        if compare.opcode != "compare":
            return None
        direction = _attr(compare.attrs, "direction")

        def tuple_index(name):
            instr = cond.get(name)
            if instr is not None and instr.opcode == "get-tuple-element":
                return int(_attr(instr.attrs, "index"))
            return None

        counter = tuple_index(operands[0])
        if counter is None:
            return None
        bound_index = tuple_index(operands[1])
        bound_value = self.int_value(cond, operands[1]) if bound_index is None else None
        return counter, bound_index, bound_value, direction

    def trip_count(self, comp, loop, depth=0):
        known = _TRIP_COUNT.search(loop.attrs)
        if known:
            return int(known.group(1))
        counter = self.loop_counter(loop)
        if counter is None:
            return None
        index, bound_index, bound, direction = counter
        init = self.int_value(comp, self.loop_init(comp, loop, index), depth + 1)
        if bound_index is not None:
            bound = self.int_value(comp, self.loop_init(comp, loop, bound_index), depth + 1)
        if init is None or bound is None or direction not in ("LT", "LE"):
            return None
        return max(0, bound - init + (direction == "LE"))

    # --- FLOPs ---------------------------------------------------------------------------------
    def flops(self, name):
        if name in self.memo:
            return self.memo[name]
        comp = self.computations[name]
        total = {"dot": 0, "convolution": 0}
        for instr in comp.values():
            if instr.opcode == "dot":
                total["dot"] += dot_flops(instr, comp)
            elif instr.opcode == "convolution":
                total["convolution"] += convolution_flops(instr, comp)
            elif instr.opcode == "custom-call":
                target = _attr(instr.attrs, "custom_call_target")
                if target is not None:
                    self.result.custom_calls.append(target.strip('"'))
            called = dict(_CALLED.findall(instr.attrs))
            if instr.opcode == "while":
                trip = self.trip_count(comp, instr)
                op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
                label = op_name.group(1) if op_name else instr.name
                self.result.loops.append((label, trip))
                if trip is None:
                    self.result.unresolved_loops.append(label)
                    trip = 1
                for sub in (called["body"], called["condition"]):
                    for kind, value in self.flops(sub).items():
                        total[kind] += trip * value
            elif instr.opcode == "conditional":  # the costliest branch: an upper bound
                indexed = _BRANCHES.search(instr.attrs)
                branches = (
                    re.findall(r"%?([\w.\-]+)", indexed.group(1))
                    if indexed
                    else _TRUE_FALSE.findall(instr.attrs)
                )
                costs = [self.flops(b) for b in branches]
                worst = max(costs, key=lambda c: sum(c.values()))
                for kind, value in worst.items():
                    total[kind] += value
            elif "calls" in called or instr.opcode == "call":
                sub = called.get("calls", called.get("to_apply"))
                for kind, value in self.flops(sub).items():
                    total[kind] += value
            # reduce, sort, scatter, map ...: their `to_apply` is scalar code, no matmuls.
        self.memo[name] = total
        return total


def count_flops(hlo_text):
    """The :class:`FlopCount` of one run of the HLO module `hlo_text` (its ENTRY)."""
    computations, entry = parse_hlo(hlo_text)
    counter = _Counter(computations)
    by_kind = counter.flops(entry)
    result = counter.result
    result.dot, result.convolution = by_kind["dot"], by_kind["convolution"]
    result.total = result.dot + result.convolution
    return result


def compiled_flops(function, *args):
    """:func:`count_flops` of `function` (a `tf.function(jit_compile=True)`) called on `args`.

    This compiles the function once more (XLA hands out the optimized HLO only by compiling).
    """
    hlo = function.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    return count_flops(hlo)

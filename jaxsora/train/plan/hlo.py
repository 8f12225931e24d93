"""What a compiled step does, read from its optimized HLO text (`compiled.as_text()`, one device's program):
its matmul FLOPs and the facts the structural tests assert on (which kernels run, which collectives move what).

FLOPs are counted where XLA's own `cost_analysis()` is missing (XLA:GPU in jaxlib 0.10.2) or blind (custom calls):
per device, each op's multiply-adds × 2, times how often its computation runs (a `while` body its known trip count:
`model.scan_blocks`), for
- `dot` (`lhs_contracting_dims` of its left operand) and cuBLAS calls (`__cublas$gemm`, `__cublas$lt$matmul`: the
  dot dimensions in their backend config),
- cuDNN fused attention (`__cudnn$fmha*`): forward 2 matmuls of [Nq, Nk, Dh] per batch and head, backward 5 (flash
  attention's backward recomputes the scores),
- convolutions (`convolution`, `__cudnn$conv*`): output elements × the kernel's window and input features.
Elementwise work (norms, softmax outside cuDNN, the optimizer) is not counted: this is the matmul count that
`plan/mfu.py`'s formula makes by hand, but of the program as it runs — rematerialized recomputation, the frozen
encoders and all.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*[ (].*\{\s*$")


@dataclasses.dataclass
class Instr:
    name: str
    shapes: list  # [(dtype, dims)] — one for an array, several for a tuple
    op: str
    operands: list  # operand names
    attrs: str  # everything after the operand list

    @property
    def dims(self) -> tuple:
        return self.shapes[0][1] if self.shapes else ()

    @property
    def dtype(self) -> str:
        return self.shapes[0][0] if self.shapes else ""

    def target(self) -> str:
        m = re.search(r'custom_call_target="([^"]+)"', self.attrs)
        return m.group(1) if m else ""

    def config(self) -> dict:
        m = re.search(r"backend_config=(\{.*\})(?:,\s*\w+=|$)", self.attrs)
        if not m:
            return {}
        text = m.group(1)
        for end in range(len(text), 0, -1):  # the JSON object, without whatever attributes follow it
            if text[end - 1] == "}":
                try:
                    return json.loads(text[:end])
                except ValueError:
                    continue
        return {}


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes text[start] ('(' or '{')."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


def _shapes(text: str) -> list:
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(text)]


def parse(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """({computation: [Instr]}, the entry computation's name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(1)
                comps[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = _matching(rest, 0)
            shape_text, rest = rest[:end], rest[end:].lstrip()
        else:
            shape_text, _, rest = rest.partition(" ")
        op_m = re.match(r"([\w\-]+)\(", rest)
        if not op_m:
            continue
        start = op_m.end() - 1
        end = _matching(rest, start)
        operands = re.findall(r"%([\w.\-]+)", rest[start:end])
        comps[current].append(Instr(name, _shapes(shape_text), op_m.group(1), operands, rest[end:]))
    return comps, entry


def _contracting(attrs_or_list, lhs_dims: tuple) -> int:
    return math.prod(lhs_dims[int(i)] for i in attrs_or_list) if lhs_dims else 0


def _op_flops(ins: Instr, table: dict) -> float:
    """Matmul FLOPs of one instruction (0 for anything else)."""
    def shape_of(name):
        src = table.get(name)
        return src.dims if src is not None else ()

    if ins.op == "dot":
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        lhs = shape_of(ins.operands[0]) if ins.operands else ()
        k = _contracting([x for x in m.group(1).split(",") if x], lhs) if m else 0
        return 2.0 * math.prod(ins.dims) * k
    if ins.op == "convolution" or (ins.op == "custom-call" and ins.target().startswith("__cudnn$conv")):
        # the forward convolution's dim_labels (input_kernel->output); a backward-filter call computes the kernel
        # from the input and the output's gradient, a backward-input call the input from (output grad, kernel):
        # each the forward's multiply-adds, output elements × the kernel's window × input features
        m = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
        filter_grad = "BackwardFilter" in ins.target()
        kernel = ins.dims if filter_grad else (shape_of(ins.operands[1]) if len(ins.operands) > 1 else ())
        out = (shape_of(ins.operands[1]) if len(ins.operands) > 1 else ()) if filter_grad else \
            (shape_of(ins.operands[0]) if "BackwardInput" in ins.target() else ins.dims)
        if not m or not kernel or not out or "o" not in m.group(1) or len(kernel) != len(m.group(1)):
            return 0.0
        out_features = kernel[m.group(1).index("o")]
        return 2.0 * math.prod(out) * math.prod(kernel) / max(1, out_features)
    if ins.op != "custom-call":
        return 0.0
    target = ins.target()
    if target in ("__cublas$gemm", "__cublas$lt$matmul"):
        cfg = ins.config().get("gemm_backend_config", {})
        dims = cfg.get("dot_dimension_numbers", {})
        lhs = shape_of(ins.operands[0]) if ins.operands else ()
        return 2.0 * math.prod(ins.dims) * _contracting(dims.get("lhs_contracting_dimensions", []), lhs)
    if target.startswith("__cudnn$fmha"):
        cfg = ins.config().get("cudnn_fmha_backend_config", {})
        scores = [int(x) for x in cfg.get("intermediate_tensor_shape", {}).get("dimensions", [])]
        if len(scores) != 4 or not ins.dims:
            return 0.0
        matmuls = 5 if "Backward" in target else 2
        return 2.0 * matmuls * math.prod(scores) * ins.dims[-1]
    return 0.0


_CALLS = re.compile(r"\b(calls|body|true_computation|false_computation)=%?([\w.\-]+)")


def matmul_flops(text: str) -> float:
    """Matmul FLOPs one device runs for one call of the compiled program (see the module docstring)."""
    comps, entry = parse(text)
    if entry is None:
        return 0.0
    tables = {c: {i.name: i for i in instrs} for c, instrs in comps.items()}
    memo: dict[str, float] = {}

    def total(comp: str, depth: int = 0) -> float:
        if comp in memo:
            return memo[comp]
        if depth > 64 or comp not in comps:
            return 0.0
        out = 0.0
        for ins in comps[comp]:
            out += _op_flops(ins, tables[comp])
            trips = 1
            if ins.op == "while":
                n = ins.config().get("known_trip_count", {}).get("n")
                trips = int(n) if n else 1
            branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            if branches:
                names = re.findall(r"%?([\w.\-]+)", branches.group(1))
                out += max((total(b, depth + 1) for b in names), default=0.0)
            for kind, callee in _CALLS.findall(ins.attrs):
                out += trips * total(callee, depth + 1) if kind == "body" else total(callee, depth + 1)
        memo[comp] = out
        return out

    return total(entry)


@dataclasses.dataclass
class Facts:
    """What the structural tests read from one device's program."""

    custom_calls: dict  # target → count
    collectives: dict  # "all-gather" | "reduce-scatter" | "all-reduce" | "all-to-all" → output [(dtype, dims)]
    instrs: list  # every Instr, for searches of shapes and dtypes


def facts(text: str) -> Facts:
    comps, _ = parse(text)
    calls: dict = {}
    coll: dict = {k: [] for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")}
    every = []
    for instrs in comps.values():
        for ins in instrs:
            every.append(ins)
            if ins.op == "custom-call":
                calls[ins.target()] = calls.get(ins.target(), 0) + 1
            base = ins.op.removesuffix("-start").removesuffix("-done")
            if base in coll and not ins.op.endswith("-done"):
                # a combined collective's output is a tuple of its arrays; an async start's (but all-reduce's) is
                # (inputs, outputs): the outputs are its second half
                starts = ins.op.endswith("-start") and ins.op != "all-reduce-start"
                shapes = ins.shapes[len(ins.shapes) // 2:] if starts else ins.shapes
                coll[base].extend(shapes)
    return Facts(calls, coll, every)

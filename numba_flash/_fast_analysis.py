"""Faster IR analyses for kernels with many blocks: the same answers, with less work.

Numba's front end works on a kernel after every device function is inlined, and for the
Hopper kernels that is hundreds of blocks and thousands of variables. Two of its analyses
took 4 of the 8.7 seconds of the Hopper forward's compile (profile, numba-cuda 0.30.4):

* **Liveness** (``analysis.compute_live_map``, run by the IR post-processor after
  inlining, after SSA reconstruction and in later passes): numba sweeps all blocks in the
  order of their labels until nothing changes, twice (the definitions reaching each block,
  then the live variables), uniting Python sets of thousands of names block by block; after
  inlining, labels are not in the order of the control flow, so the sweeps repeat.
  :func:`compute_live_map` solves the same two systems of equations with the sets as bits
  of Python integers (one bit per variable) and work lists (a block is visited again only
  when its inputs changed). Both are least fixed points of monotone set equations from the
  same starting sets, which any fair order of updates reaches: the result is equal set for
  set.
* **SSA reconstruction** (``ssa._run_ssa``): for each variable assigned more than once it
  rewrites every statement of every block, twice. A block whose statements never name the
  variable comes out of those rewrites unchanged (the handlers act only on statements that
  define or use it), and rewriting one variable never makes a block name another, so
  :func:`_run_ssa` lists once which variables each block names and the rewrites pass the
  other blocks through as they are (new blocks holding the same statements, as before).

* **Flag comparisons** (``TargetConfig.values``, behind the ``__hash__`` and ``__eq__``
  of the compile flags that every typing template's cache lookup hashes and compares:
  tens of thousands of times per kernel, a tenth of a compile): numba builds the dict of
  every option through one property call each; :func:`_flag_values` builds the same dict
  (same keys, in the same order, and values) from the class's defaults and the options
  set.
* **Arithmetic on scalars** (``npydecl.NumpyRulesArrayOperator.generic``, one of the
  templates every binary operator is tried against): numba resolves the operator as a
  NumPy ufunc (its loop found by casting rules) and only then returns None when no operand
  is an array, which scalars never are: 15% of the Hopper forward's typing.
  :func:`_array_operator` returns the same None before the resolution.
* **ABI sizes** (``BaseContext.get_abi_sizeof``, asked at every stack slot the lowering
  makes): llvmlite prints a module holding a global of the type and parses it with LLVM
  each time (2% of a compile). :func:`_abi_sizeof` keeps the answer per type, by its
  text, for the types whose text is their whole definition (all but named structs).
* **Post-processing** (``postproc.PostProcessor.run``, after inlining and most IR
  passes: 12% of the compiles of a shard of the PTX checks): numba computes each block's
  dead variables and, from them, the variables live on entry to each block
  (``block_entry_vars``), which only generators read (their state, and
  ``get_block_entry_vars``); the dead variables are read again only when the run inserts
  ``del`` statements. :func:`_postproc_run` does the rest of ``run`` as numba does for
  functions that are not generators, and leaves the control flow, the uses and
  definitions and the live map to ``func_ir.variable_lifetime`` (numba's
  ``VariableLifetime``, which computes each on first use: the dead variables need them
  only with ``emit_dels``): of the 192 runs while the Hopper forward compiles, 43 have
  them read, and the kernels compile to the same PTX (the other runs' analyses were of
  IR that the next inline changed).
* **Call signatures** (``typing.context.BaseContext.resolve_function_type``, the typing
  of every call, operator and iteration): an unrolled kernel asks the same questions
  over and over (the Hopper forward: 4365 calls, 347 distinct), and numba tries each
  function's templates afresh every time (a tenth of a compile).
  :func:`_resolve_function_type` remembers the answers per typing context for builtin
  functions and operators, templates' functions and methods, and the names numba resolves
  (``getiter``): each answer depends on nothing but the function and the argument types.
* **Function types' resolutions** (``BaseFunction.get_call_type``, which lowering asks
  directly for every operator with a constant operand, past the context's memo above:
  5% of the Hopper forward's compile). :func:`_get_call_type` remembers each answer per
  function type, typing context, target and argument types, with the implementation key
  it recorded, which a repeat records again.
* **A BLAS check at import** (``numba.cuda.np.arraymath``, imported by the first
  compile of a process): numba-cuda decides whether ``np.dot`` may call a BLAS by
  importing ``scipy.linalg.cython_blas``, which brings scipy.linalg, numpy.f2py and
  charset_normalizer along: 0.12-0.19 s of a first call, for a BLAS no kernel calls.
  :func:`_import_arraymath` imports that module with a check that finds the same
  extension module's file without importing it.
* **Error texts** (``errors.HighlightColorScheme._markup``): typing builds the message
  of every template that does not match a call (thousands per kernel, read only if the
  call fails to type), and numba marks each part of it up inside colorama's
  ``init()``/``deinit()`` (each wraps ``sys.stdout`` and ``sys.stderr`` anew): 0.14 s
  per 9000 marked-up texts, about as many as a Hopper forward's compile builds.
  :func:`_markup` returns the same text (the style codes, the message, the reset code)
  without wrapping the streams, which the text never depended on.
* **Pointer types** (``llvmlite.ir.Type.as_pointer``, called by every ``getelementptr``
  the lowering builds): llvmlite makes a new pointer type object each time, and each
  prints its own text when the module is printed for NVVM (5% of a compile, both).
  :func:`_as_pointer` gives one object per pointee object and address space. llvmlite's
  types are values (equal by their pointee and address space, never changed once made:
  a named struct's body changes its own text, not its pointer's), so sharing one is
  what making another equal one was.

``tests/test_runtime.py`` compares the liveness with numba's on the IR of real kernels and
compiles kernels both ways to the same PTX. Installed for the numba-cuda this package pins
(0.30.4) only, and not when ``NUMBA_FLASH_FAST_ANALYSIS=0``.
"""
import threading
from collections import defaultdict, deque

from ._runtime import classes_named, pinned_numba_cuda

ENV = "NUMBA_FLASH_FAST_ANALYSIS"
_originals = {}
_local = threading.local()


def _grow(sets, nodes, neighbours, flow):
    """The least solution above the starting ``sets`` of ``sets[n] ⊇ flow(n, sets[m])`` for
    every node ``m`` of ``nodes`` and each ``n`` of ``neighbours(m)``, by a work list: a node
    is visited again when its set grew (if it is one of ``nodes``)."""
    todo = deque(nodes)
    queued = set(todo)
    while todo:
        node = todo.popleft()
        queued.discard(node)
        here = sets[node]
        for other, _ in neighbours(node):
            new = flow(other, here)
            if not new:
                continue
            there = sets[other]
            if new & ~there:
                sets[other] = there | new
                if other in nodes and other not in queued:
                    todo.append(other)
                    queued.add(other)


def compute_live_map(cfg, blocks, var_use_map, var_def_map):
    """The variables alive at the entry of each block (numba's ``compute_live_map``)."""
    index = {}                                # variable name -> bit
    for table in (var_def_map, var_use_map):
        for names in table.values():
            for name in names:
                index.setdefault(name, len(index))
    names = list(index)

    def bits(found):
        out = 0
        for name in found:
            out |= 1 << index[name]
        return out

    defs = {label: bits(found) for label, found in var_def_map.items()}
    uses = {label: bits(found) for label, found in var_use_map.items()}
    # definitions and uses that reach each block: its own, and those of every block that
    # reaches it
    reach = defaultdict(int)
    for label in var_def_map:
        reach[label] |= defs[label] | uses[label]
    _grow(reach, var_def_map, cfg.successors, lambda succ, here: here)
    # live at entry: used before defined here, or live at a successor, reached and not
    # defined here (a predecessor outside ``blocks`` gets no entry, as in numba)
    live = {label: uses[label] for label in blocks}
    _grow(live, live, cfg.predecessors,
          lambda pred, here: here & reach[pred] & ~defs[pred] if pred in live else 0)
    out = {}
    for label, found in live.items():
        alive = set()
        while found:
            low = found & -found
            alive.add(names[low.bit_length() - 1])
            found ^= low
        out[label] = alive
    return out


def _run_ssa(blocks):
    """numba's ``ssa._run_ssa`` with the names each block's statements mention listed once."""
    outer = getattr(_local, "mentions", None)
    _local.mentions = {label: {var.name for stmt in block.body for var in stmt.list_vars()}
                       for label, block in blocks.items()}
    try:
        return _originals["_run_ssa"](blocks)
    finally:
        _local.mentions = outer


def _run_block_rewrite(blocks, states, handler):
    """numba's ``ssa._run_block_rewrite``, passing through the blocks that never name the
    variable being rewritten (its ``states["varname"]``)."""
    mentions = getattr(_local, "mentions", None)
    varname = states.get("varname")
    if mentions is None or varname is None:
        return _originals["_run_block_rewrite"](blocks, states, handler)
    from numba.cuda.core import ir
    rewrite = _originals["_run_block_rewrite"]
    newblocks = {}
    for label, blk in blocks.items():
        if varname in mentions.get(label, (varname,)):
            newblocks.update(rewrite({label: blk}, states, handler))
        else:
            newblk = ir.Block(scope=blk.scope, loc=blk.loc)
            newblk.body = list(blk.body)
            newblocks[label] = newblk
    return newblocks


_DEFAULTS = {}     # TargetConfig subclass -> {option: default}, in the options' order


def _flag_values(self):
    """``TargetConfig.values``: every option's value, set or default."""
    cls = type(self)
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        defaults = _DEFAULTS[cls] = {name: option.default for name, option in cls.options.items()}
    return {**defaults, **self._values} if self._values else dict(defaults)


def _array_operator(self, args, kws):
    """``NumpyRulesArrayOperator.generic``: None at once when no operand is an array (what
    numba returns after resolving the ufunc: its signature's operands are these)."""
    from numba.cuda import types
    if not any(isinstance(arg, types.ArrayCompatible) for arg in args):
        return None
    return _originals["array_operator"](self, args, kws)


_DEFAULT_STYLE = object()
_STYLES = {}        # colorama's Style.BRIGHT (numba's default style) and Style.RESET_ALL, from install()


def _markup(self, msg, color=None, style=_DEFAULT_STYLE):
    """``HighlightColorScheme._markup``: the text numba's makes (``color``, ``style``,
    the message, colorama's reset code), without colorama's ``init()``/``deinit()``
    around it."""
    if style is _DEFAULT_STYLE:
        style = _STYLES["bright"]
    return (color or "") + (style or "") + msg + _STYLES["reset"]


_CALLS = "_numba_flash_call_types"      # a typing context's remembered call signatures
_REMEMBERED = ()                        # (str, types.Function, types.BoundFunction), from install()


def _memo(obj, name):
    """The dict of remembered answers kept on ``obj`` under the attribute ``name``."""
    memo = obj.__dict__.get(name)
    if memo is None:
        memo = obj.__dict__[name] = {}
    return memo


def _resolve_function_type(self, func, args, kws):
    """``BaseContext.resolve_function_type``: remembered per typing context for the calls
    whose signature depends on nothing but the function and the argument types (builtin
    operators and functions, ``bool``, templates' functions and methods, the iterator
    protocol's names): an unrolled kernel asks the same few hundred questions thousands
    of times. Failures and unresolved calls are not remembered (asked afresh, as numba
    does)."""
    if not isinstance(func, _REMEMBERED):
        return _originals["resolve_function_type"](self, func, args, kws)
    memo = _memo(self, _CALLS)
    try:
        key = (func, tuple(args), tuple(sorted(kws.items())) if kws else ())
        found = memo.get(key)
    except TypeError:                        # an unhashable argument type
        return _originals["resolve_function_type"](self, func, args, kws)
    if found is None:
        found = _originals["resolve_function_type"](self, func, args, kws)
        if found is not None:
            memo[key] = found
    return found


_CALL_TYPES = "_numba_flash_resolutions"   # a function type's remembered resolutions


def _get_call_type(self, context, args, kws):
    """``BaseFunction.get_call_type`` (a builtin function type's templates tried in
    turn): remembered per function type, typing context, target and argument types,
    with the implementation key the resolution recorded, which each repeat records
    again as a fresh resolution would. Lowering asks it once per operator with a
    constant operand, bypassing the context's own memo (:func:`_resolve_function_type`).
    Failures (raised) are not remembered; calls with keywords are not remembered."""
    if kws:
        return _originals["get_call_type"](self, context, args, kws)
    memo = _memo(self, _CALL_TYPES)
    try:
        key = (context, _originals["get_local_target"](context), tuple(args))
        found = memo.get(key)
    except TypeError:                        # an unhashable argument type
        return _originals["get_call_type"](self, context, args, kws)
    if found is None:
        sig = _originals["get_call_type"](self, context, args, kws)
        found = memo[key] = (sig, self._impl_keys.get(sig.args))
    sig, impl_key = found
    self._impl_keys[sig.args] = impl_key
    return sig


_ABI_SIZES = {}     # (target data, type text) -> ABI size


def _abi_sizeof(self, ty):
    """``BaseContext.get_abi_sizeof``: remembered per target data and type text (a named
    struct's text is its name, not its fields: asked afresh)."""
    from llvmlite import ir
    if isinstance(ty, ir.IdentifiedStructType):
        return _originals["abi_sizeof"](self, ty)
    key = (self.target_data, str(ty))
    found = _ABI_SIZES.get(key)
    if found is None:
        found = _ABI_SIZES[key] = _originals["abi_sizeof"](self, ty)
    return found


def _as_pointer(self, addrspace=0):
    """``llvmlite.ir.Type.as_pointer``: one pointer type per pointee object and address
    space, kept on the pointee."""
    made = self.__dict__.get("_numba_flash_pointers")
    if made is None:
        made = self.__dict__["_numba_flash_pointers"] = {}
    found = made.get(addrspace)
    if found is None:
        found = made[addrspace] = _originals["as_pointer"](self, addrspace)
    return found


def _postproc_run(self, emit_dels=False, extend_lifetimes=False):
    """``PostProcessor.run`` as numba's, without the entry variables of a function that
    is not a generator (see the module's doc)."""
    func_ir = self.func_ir
    if func_ir.is_generator:
        return _originals["postproc_run"](self, emit_dels, extend_lifetimes)
    from numba.cuda.core import postproc, transforms
    func_ir.blocks = transforms.canonicalize_cfg(func_ir.blocks)
    vlt = func_ir.variable_lifetime = postproc.VariableLifetime(func_ir.blocks)
    func_ir.generator_info = None
    if emit_dels:
        self._insert_var_dels(extend_lifetimes=extend_lifetimes)


def install():
    """Use this module's analyses in numba-cuda (once; True if they apply)."""
    if _originals:
        return True
    if not pinned_numba_cuda(ENV):
        return False
    from numba.cuda.core import analysis, ir_utils, postproc, ssa
    if getattr(ir_utils, "compute_live_map", None) is not getattr(analysis, "compute_live_map", False) \
            or not all(hasattr(ssa, name) for name in ("_run_ssa", "_run_block_rewrite")):
        return False
    from numba.cuda.core.targetconfig import TargetConfig
    from numba.cuda.typing.npydecl import NumpyRulesArrayOperator
    from numba.cuda.core.base import BaseContext
    from numba.cuda.typing.context import BaseContext as TypingContext
    from llvmlite import ir
    import importlib
    BaseFunction = _function_base()
    targets = importlib.import_module(BaseFunction.__module__.replace("types.functions", "target_extension"))
    _originals.update(resolve_function_type=TypingContext.resolve_function_type,
                      get_call_type=BaseFunction.get_call_type, get_local_target=targets.get_local_target)
    _originals.update(compute_live_map=analysis.compute_live_map, _run_ssa=ssa._run_ssa,
                      _run_block_rewrite=ssa._run_block_rewrite, values=TargetConfig.values,
                      array_operator=NumpyRulesArrayOperator.generic, abi_sizeof=BaseContext.get_abi_sizeof,
                      as_pointer=ir.Type.as_pointer, postproc_run=postproc.PostProcessor.run)
    analysis.compute_live_map = ir_utils.compute_live_map = compute_live_map    # (ir_utils: dead code removal)
    ssa._run_ssa, ssa._run_block_rewrite = _run_ssa, _run_block_rewrite
    TargetConfig.values = _flag_values
    NumpyRulesArrayOperator.generic = _array_operator
    BaseContext.get_abi_sizeof = _abi_sizeof
    ir.Type.as_pointer = _as_pointer
    postproc.PostProcessor.run = _postproc_run
    from numba.cuda import types
    global _REMEMBERED
    _REMEMBERED = (str, types.Function, types.BoundFunction)
    TypingContext.resolve_function_type = _resolve_function_type
    BaseFunction.get_call_type = _get_call_type
    _import_arraymath()
    schemes = _color_schemes()
    if schemes:
        from colorama import Style
        _STYLES.update(bright=Style.BRIGHT, reset=Style.RESET_ALL)
    for scheme in schemes:
        _originals.setdefault("markup", {})[scheme] = scheme._markup
        scheme._markup = _markup
    return True


def _blas_present():
    """Whether scipy's ``linalg.cython_blas`` extension module is installed (numba-cuda's
    ``ensure_blas`` imports it to find out), found by its file; raises ImportError as
    ``ensure_blas`` does when it is not."""
    import glob
    import importlib.util
    import os
    spec = importlib.util.find_spec("scipy")
    where = [] if spec is None or not spec.submodule_search_locations else list(spec.submodule_search_locations)
    if not any(glob.glob(os.path.join(d, "linalg", "cython_blas.*")) for d in where):
        raise ImportError("scipy 0.16+ is required for linear algebra")


def _import_arraymath():
    """Import ``numba.cuda.np.arraymath`` with :func:`_blas_present` as its BLAS check,
    then give it back numba-cuda's ``ensure_blas`` (unless a compile imported it already)."""
    import sys
    if "numba.cuda.np.arraymath" in sys.modules:
        return
    from numba.cuda.np import linalg
    original = linalg.ensure_blas
    linalg.ensure_blas = _blas_present
    try:
        from numba.cuda.np import arraymath
    finally:
        linalg.ensure_blas = original
    arraymath.ensure_blas = original


def _function_base():
    """The class whose ``get_call_type`` builtin function types use (numba's
    ``BaseFunction``, which numba-cuda's types are when numba is installed)."""
    from numba.cuda import types
    return next(c for c in types.Function.__mro__ if "get_call_type" in c.__dict__)


def _color_schemes():
    """numba-cuda's and numba's ``HighlightColorScheme`` (typing uses both; absent
    without colorama)."""
    return classes_named("HighlightColorScheme", ("numba.cuda.core.errors", "numba.core.errors"))


def uninstall():
    """Undo :func:`install` (tests compare the two)."""
    if not _originals:
        return
    from llvmlite import ir
    from numba.cuda.core import analysis, ir_utils, postproc, ssa
    from numba.cuda.core.base import BaseContext
    from numba.cuda.core.targetconfig import TargetConfig
    from numba.cuda.typing.npydecl import NumpyRulesArrayOperator
    from numba.cuda.typing.context import BaseContext as TypingContext
    TypingContext.resolve_function_type = _originals["resolve_function_type"]
    _function_base().get_call_type = _originals["get_call_type"]
    for scheme, markup in _originals.get("markup", {}).items():
        scheme._markup = markup
    TargetConfig.values = _originals["values"]
    NumpyRulesArrayOperator.generic = _originals["array_operator"]
    BaseContext.get_abi_sizeof = _originals["abi_sizeof"]
    ir.Type.as_pointer = _originals["as_pointer"]
    postproc.PostProcessor.run = _originals["postproc_run"]
    analysis.compute_live_map = ir_utils.compute_live_map = _originals["compute_live_map"]
    ssa._run_ssa, ssa._run_block_rewrite = _originals["_run_ssa"], _originals["_run_block_rewrite"]
    _originals.clear()

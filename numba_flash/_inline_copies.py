"""Faster compiles of kernels built from many inlined device functions.

Every device function of the kernels is ``inline="always"`` (Numba inlines its IR at each
call site: what lets PTX be made without a GPU, and what the simulator-free compile relies
on). To inline a callee, numba-cuda 0.30.4's ``InlineWorker.inline_ir`` deep-copies the
callee's IR one block at a time, each block with a fresh ``deepcopy`` memo, so the
callee's ``Scope`` (every variable of the function) is copied again for every block: the
cost grows with blocks × variables. Unrolled loops make many blocks, and the profile of
one CUDA-core forward kernel showed 10 of its 16 compile seconds in ``copy.deepcopy``.

:func:`install` makes the copies of one ``inline_ir`` call share one copy of each scope,
which is what a single ``deepcopy`` of all the blocks would give (the blocks of a function
share one scope; the inliner then points them at the caller's). The IR that results is
the same, and so is the code.

Each call site of a device function also ran the callee's whole front end again (bytecode,
IR, its own inlining) before the copy: :func:`install` keeps each callee's IR for the
compile under way (numba's ``Flags`` object of that compile) and hands the inliner that,
which copies it before changing anything, as it copied a fresh one before (the Hopper
forward: 4.3 → 3.6 s to PTX).

``inline_ir`` also copies the callee's IR a second time, "an unmutated copy of the callee
IR to return", which both of numba-cuda's callers discard (``_, _, _, new_blocks =
...``): within an ``inline_ir`` call, :func:`install` has ``copy.deepcopy`` of a block
that the same call's first copy made return that block (half the copying). And source
locations (``ir.Loc``: file, line, column, and a cache of the file's lines) are shared by
copies instead of copied: nothing changes a ``Loc`` after it is made (the compiler makes
new ones), and each IR node holds one. The nodes an inline copies most (assignments,
expressions, blocks, jumps, branches: nine in ten of the objects it copies) get a
``__deepcopy__`` (:func:`_node_deepcopy`) that makes what the ``copy`` module's generic
path makes (a new object of the class, its attributes deep copies in their order) without
that path's steps, and without calls for immutable attributes (a third off the copies'
time). ``tests/test_runtime.py`` compiles kernels both
ways and compares their PTX. It applies to the numba-cuda this package pins (0.30.4) and is left
out for any other, or when ``NUMBA_FLASH_SHARED_SCOPE_COPIES=0``.
"""
import copy
import threading

from ._runtime import pinned_numba_cuda

ENV = "NUMBA_FLASH_SHARED_SCOPE_COPIES"
_local = threading.local()
_installed = False


def _scope_deepcopy(self, memo):
    """``copy.deepcopy`` of a Scope: within an ``inline_ir`` call, one copy per scope."""
    shared = getattr(_local, "scopes", None)
    if shared is not None:
        found = shared.get(id(self))
        if found is not None:
            memo[id(self)] = found
            return found
    new = self.__class__.__new__(self.__class__)
    memo[id(self)] = new
    if shared is not None:
        shared[id(self)] = new
    new.__dict__.update(copy.deepcopy(self.__dict__, memo))
    return new


class _CopyModule:
    """What ``inline_closurecall`` sees as its ``copy`` module: ``deepcopy`` of a block
    that this ``inline_ir`` call's first copy made returns that block (its only other
    copy is the discarded one); everything else is the ``copy`` module's."""

    def __getattr__(self, name):
        return getattr(copy, name)

    @staticmethod
    def deepcopy(x, memo=None):
        made = getattr(_local, "made", None)
        if made is None:
            return copy.deepcopy(x, memo)
        if id(x) in made:
            return x
        new = copy.deepcopy(x, memo)
        made[id(new)] = new                     # (kept alive, so its id stays unique)
        return new


def _share_loc(self, memo):
    """``copy.deepcopy`` of an ``ir.Loc``: the same object (see the module's doc)."""
    return self


# IR nodes copied by :func:`_node_deepcopy` (most of what an inline copies), and the
# values it shares instead of passing them to ``copy.deepcopy`` (which returns them as
# they are: immutable, or ``ir.Loc``, shared by :func:`_share_loc`)
_NODES = ("Assign", "Expr", "Block", "Jump", "Branch", "Return", "SetItem", "StaticSetItem", "Arg")
_SHARED = {str, int, float, bool, type(None)}


def _node_deepcopy(self, memo):
    """``copy.deepcopy`` of an IR node whose state is its ``__dict__``: what the ``copy``
    module's ``__reduce_ex__`` path makes (a new object of the class, its attributes deep
    copies in their order, the node in ``memo`` before its attributes are copied), without
    that path's generic steps or calls for immutable attributes."""
    cls = self.__class__
    new = cls.__new__(cls)
    memo[id(self)] = new
    state = new.__dict__
    deep = copy.deepcopy
    for name, value in self.__dict__.items():
        state[name] = value if type(value) in _SHARED else deep(value, memo)
    return new


def install():
    """Patch numba-cuda's inliner as described above (once; True if it applies)."""
    global _installed
    if _installed:
        return True
    if not pinned_numba_cuda(ENV):
        return False
    from numba.cuda.core import inline_closurecall, ir
    worker = inline_closurecall.InlineWorker
    nodes = [getattr(ir, name, None) for name in _NODES]
    if any(cls is None or any(name in vars(cls) for name in ("__deepcopy__", "__slots__", "__reduce__",
                                                             "__reduce_ex__", "__getstate__", "__setstate__"))
           for cls in nodes) \
            or "__deepcopy__" in vars(ir.Scope) or "__deepcopy__" in vars(ir.Loc) or not all(
            hasattr(worker, name) for name in ("inline_ir", "inline_function", "run_untyped_passes")) \
            or inline_closurecall.copy is not copy:
        return False
    original = worker.inline_ir
    original_function = worker.inline_function

    def inline_ir(self, *args, **kwargs):
        outer = getattr(_local, "scopes", None), getattr(_local, "made", None)
        _local.scopes, _local.made = {}, {}
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.scopes, _local.made = outer

    def inline_function(self, caller_ir, block, i, function, arg_typs=None):
        flags, callees = getattr(_local, "callees", (None, None))
        if flags is not self.flags:                  # another compile: start afresh
            flags, callees = _local.callees = (self.flags, {})
        callee_ir = callees.get(function)
        if callee_ir is None:
            callee_ir = callees[function] = self.run_untyped_passes(function)
        else:
            self.flags.enable_ssa = False            # as run_untyped_passes leaves the flags
        return self.inline_ir(caller_ir, block, i, callee_ir, function.__code__.co_freevars, arg_typs=arg_typs)

    inline_ir.__wrapped__ = original
    inline_function.__wrapped__ = original_function
    worker.inline_ir = inline_ir
    worker.inline_function = inline_function
    ir.Scope.__deepcopy__ = _scope_deepcopy
    ir.Loc.__deepcopy__ = _share_loc
    _SHARED.add(ir.Loc)
    for cls in nodes:
        cls.__deepcopy__ = _node_deepcopy
    inline_closurecall.copy = _CopyModule()
    _installed = True
    return True


def uninstall():
    """Undo :func:`install` (tests compare the two)."""
    global _installed
    if not _installed:
        return
    from numba.cuda.core import inline_closurecall, ir
    worker = inline_closurecall.InlineWorker
    worker.inline_ir = worker.inline_ir.__wrapped__
    worker.inline_function = worker.inline_function.__wrapped__
    _local.callees = (None, None)
    del ir.Scope.__deepcopy__
    del ir.Loc.__deepcopy__
    _SHARED.discard(ir.Loc)
    for name in _NODES:
        del getattr(ir, name).__deepcopy__
    inline_closurecall.copy = copy
    _installed = False

"""Counts Triton JIT compilations in this process, and those after the server said it was ready.

A kernel variant first needed while serving costs the request that meets it a compile (seconds;
a disk-cache load when an earlier run compiled it): every variant the scheduler can produce
belongs in start-up (engine/warmup.py). After `mark_ready()` each new variant is counted and
logged as a WARNING naming the kernel and its specialization, so a miss is visible.

Triton's hook moved between versions: `triton.knobs.runtime.jit_post_compile_hook` (3.4 and up),
`JITFunction.compiled_hook` / `JITFunction.cache_hook` before. Any hook already set is chained.
"""
import logging
import threading
from collections import Counter

logger = logging.getLogger(__name__)


class CompileWatch:
    def __init__(self) -> None:
        self.total = 0
        self.after_ready = 0
        self.ready = False
        self.by_kernel: Counter[str] = Counter()  # after ready, by kernel name
        self.installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Hook Triton's JIT (idempotent); False when Triton is missing or has no hook we know."""
        if self.installed:
            return True
        try:
            import triton
        except ImportError:
            return False
        knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        if knobs is not None and hasattr(knobs, "jit_post_compile_hook"):
            previous = knobs.jit_post_compile_hook
            knobs.jit_post_compile_hook = self._hook(previous)
        else:
            from triton.runtime.jit import JITFunction

            attr = "compiled_hook" if hasattr(JITFunction, "compiled_hook") else "cache_hook"
            if not hasattr(JITFunction, attr):
                logger.warning("Triton %s has no compile hook we know: compilations are not counted",
                               getattr(triton, "__version__", "?"))
                return False
            setattr(JITFunction, attr, self._hook(getattr(JITFunction, attr)))
        self.installed = True
        return True

    def _hook(self, previous):
        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", None) or "?"
            self.record(str(name), str(kwargs.get("repr", "")))
            # cache_hook (old Triton) skips the compile when it returns True: pass the previous answer on
            return previous(*args, **kwargs) if previous is not None else None
        return hook

    def record(self, kernel: str, detail: str = "") -> None:
        """One compilation of `kernel` (detail: Triton's repr of its specialization)."""
        with self._lock:
            self.total += 1
            if not self.ready:
                return
            self.after_ready += 1
            self.by_kernel[kernel] += 1
        logger.warning("kernel compiled after the server was ready (%d so far): %s %s; its first request "
                       "waited for the compile: this variant belongs in start-up (engine/warmup.py)",
                       self.after_ready, kernel, detail[:600])

    def mark_ready(self) -> None:
        with self._lock:
            self.ready = True
        logger.info("%d Triton kernel variants compiled or loaded before ready", self.total)


WATCH = CompileWatch()

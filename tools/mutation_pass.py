"""A mutation pass over the KV layer, the scheduler with its fairness policies, and the engine's request table:
plant one realistic bug, run the tests, put it back.

Why: a test that cannot fail is a defect, and the only way to know a test *can* fail is to make the code
wrong and watch.  Each row below is one small bug of the kind these modules invite (an off-by-one, a count
left out, a guard dropped); a row the tests do not catch ("SURVIVED") is either a missing test or a bug that
changes only *when* tokens are produced -- its ``note`` says which, where known.

    python tools/mutation_pass.py            # every row (62 min for 63 on a busy 2-core VM; 21 for 52 on a quiet one)
    python tools/mutation_pass.py 5 12       # rows 5 and 12 only

Each file is restored from memory after its run, whatever happens short of SIGKILL (a SIGTERM -- ``timeout``, a
cancelled CI job, a plain ``kill`` -- is turned into an exit so the restore still runs); do not edit the tree
while it runs.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
KVM, SCH, FAIR = "minivllm/kv/kv_cache_manager.py", "minivllm/sched/scheduler.py", "minivllm/sched/fairness.py"
POOL, LEAVES = "minivllm/kv/block_pool.py", "minivllm/kv/prefix/base.py"
RADIX, HASH, ENGINE = "minivllm/kv/prefix/radix.py", "minivllm/kv/prefix/hash_index.py", "minivllm/engine/llm_engine.py"
LEARNER, REQ = "minivllm/kv/prefix/learner.py", "minivllm/request.py"

# (what the bug is, file, the text it replaces, the bug, note)
MUTANTS = [
    ("swap-out copies the not-yet-written copy-on-write target", KVM,
     "append((pending.get(gpu, gpu), req.cpu_block_ids[-1]))", "append((gpu, req.cpu_block_ids[-1]))", ""),
    ("pending copies forgotten by source", KVM, "self._moves.copies if d not in gone]",
     "self._moves.copies if s not in gone]", ""),
    ("free keeps num_inserted_blocks", KVM, "req.num_computed_tokens = 0\n        req.num_inserted_blocks = 0",
     "req.num_computed_tokens = 0", ""),
    ("a partly filled block is cached", KVM, "full = min(req.num_computed_tokens // bs, len(req.block_ids))",
     "full = len(req.block_ids)", ""),
    ("swap-in leaks host blocks", KVM,
     "        self.cpu_pool.free_all(req.cpu_block_ids)\n        self.stats.swapped_in_blocks",
     "        self.stats.swapped_in_blocks", ""),
    ("a shared cached prefix counted as room twice", KVM, "sum(1 for b in unpinned if b not in hit)",
     "len(unpinned)", ""),
    ("no copy-on-write on the fast path", KVM, "computed % bs == 0 or self.pool.refcount(blocks[-1]) == 1",
     "True", ""),
    ("protect_after off by one at admission", SCH, "(not limit or r.num_preemptions < limit)",
     "(not limit or r.num_preemptions <= limit)", ""),
    ("a ranked admission's budget leaves out running decodes", SCH,
     "total, grouped = p.decodes", "total, grouped = 0, {}", ""),
    ("admission under-counts a capped group's reserved blocks", SCH,
     "u.blocks += gained + reserved", "u.blocks += gained", ""),
    ("reject mode turns samples away one by one", SCH,
     'preemption_mode == "reject" and req.status is RequestStatus.WAITING and req.leader is None',
     'preemption_mode == "reject" and req.status is RequestStatus.WAITING', ""),
    ("reject mode's worst case leaves out a forked sample's copy", KVM,
     "        cow = int(self._last_block_is_shared(req))\n        return max(0, blocks_for(req.max_total_tokens",
     "        cow = 0\n        return max(0, blocks_for(req.max_total_tokens", ""),
    ("a swap-in reuses a victim's blocks in the step it is swapped out", SCH,
     "p.swapped_out |= victim.status is RequestStatus.SWAPPED", "p.swapped_out |= False", ""),
    ("sharing reported at the wrong count", POOL,
     "        if self._refcount[block_id] == 1:\n            self.num_shared -= 1",
     "        if self._refcount[block_id] == 2:\n            self.num_shared -= 1", ""),
    ("a WFQ newcomer starts at the maximum counter", FAIR, "floor = min(still) if still else self._last_left",
     "floor = max(still) if still else self._last_left", ""),
    ("three_class threshold off by one", FAIR, "if len(interactive) >= self.threshold:",
     "if len(interactive) > self.threshold:", ""),
    ("eviction survivors lose their age", LEAVES, "            self.touch(leaf, tick)\n        return freed",
     "            self.touch(leaf, tick + 1)\n        return freed", ""),
    ("admission right after an allocator's preemption", SCH, "if (self._preempted_last_step or not self.waiting",
     "if (not self.waiting", ""),
    # the prefix caches, namespaces and the engine's request table
    ("radix extend ignores the namespace", RADIX,
     "if node is None or node.namespace != namespace or node.block_ids[-1] != parent_block:",
     "if node is None or node.block_ids[-1] != parent_block:", ""),
    ("hash extend ignores the namespace", HASH, "if entry is None or entry.namespace != namespace:",
     "if entry is None:", ""),
    ("radix evicts a block someone still holds", RADIX,
     "while freed < budget and node.block_ids and self.pool.refcount(node.block_ids[-1]) == 1:",
     "while freed < budget and node.block_ids and self.pool.refcount(node.block_ids[-1]) <= 2:", ""),
    ("radix grows an edge that has children", RADIX, "if not parent.is_root and not parent.children:",
     "if not parent.is_root:", ""),
    ("a split's upper half loses its age", RADIX, "            last_access=node.last_access,\n",
     "            last_access=0,\n", "expected equivalent: every split is made by a walk whose path is touched next"),
    ("hash lookup skips the token check (a collision is a hit)", HASH,
     "if entry.parent is not parent or entry.token_ids != tokens or entry.namespace != namespace:",
     "if entry.parent is not parent or entry.namespace != namespace:", ""),
    ("an evicted hash leaf does not hand its recency up", HASH,
     "parent.last_used = max(parent.last_used, entry.last_used)", "pass", ""),
    ("the quota's eviction does not pin the prefix being extended", LEAVES,
     "            if pin is not None:\n                self.pool.incref(pin)", "            if False:\n                pass",
     ""),
    ("tenants share a namespace", KVM, "tenant = None if self.share_across_tenants else req.tenant",
     "tenant = None", ""),
    ("an empty cache salt is a salt", KVM, "return (tenant, req.cache_salt or None)",
     "return (tenant, req.cache_salt)", ""),
    ("the last prompt token is matched too", KVM, "TokenRun((prompt, output) if output else (prompt,), max(len(prompt) + len(output) - 1, 0))",
     "TokenRun((prompt, output) if output else (prompt,), max(len(prompt) + len(output), 0))", ""),
    # caps, their retry hints, cache quotas and the victim rule
    ("a KV share floors to zero blocks", FAIR,
     "blocks = None if tc.max_kv_share is None else max(1, math.floor(tc.max_kv_share * n))",
     "blocks = None if tc.max_kv_share is None else math.floor(tc.max_kv_share * n)", ""),
    ("the interactive reserve is not left out of agent+batch", FAIR,
     "max_blocks=max(1, math.floor((1 - knobs.interactive_kv_reserve) * n))))",
     "max_blocks=max(1, math.floor(n))))", ""),
    ("a reject-cap ignores the seat cap", FAIR,
     "if g.would_exceed(u.seats, u.blocks, need):\n                return g",
     "if g.would_exceed(0, u.blocks, need):\n                return g", ""),
    ("the retry hint counts a finished member's seat twice", FAIR,
     "seats, blocks = seats - 1, blocks - held.remove(m)[0] - reserved(m)",
     "seats, blocks = seats - 2, blocks - held.remove(m)[0] - reserved(m)", ""),
    ("the retry hint ignores the rest of the prompt", REQ,
     "return -(-max(1, self.num_uncomputed_tokens) // chunk) + max(0, self.max_tokens - len(self.output_token_ids) - 1)",
     "return max(1, self.max_tokens - len(self.output_token_ids))", ""),
    ("the retry hint leaves out the blocks set aside for members", SCH,
     "self._reservation, self.kv.may_share(), self.kv.num_copy_on_write_blocks,",
     "lambda r: 0, self.kv.may_share(), self.kv.num_copy_on_write_blocks,", ""),
    ("the retry hint leaves out the group's waiting requests", SCH, "self.waiting, forks, reads=lambda r:",
     "(), forks, reads=lambda r:", ""),
    ("the retry hint charges a sample that will fork its whole need", FAIR, "start = forks(r) if runs else ()",
     "start = ()", ""),
    ("the retry hint keeps members that finished in the rejecting step", SCH,
     "running = [r for r in self.running if not r.status.finished]", "running = self.running", ""),
    ("the retry hint never asks the seated again", FAIR, "                        if all(b in still for b in read):",
     "                        if True:", ""),
    ("the retry hint frees a seated waiting member's seat only", FAIR,
     "seats, blocks = seats - 1, blocks - seated.pop(w)", "seats, blocks = seats - 1, blocks - 0 * seated.pop(w)", ""),
    ("the retry hint forgets the output sampled with the last chunk", REQ,
     "max(0, self.max_tokens - len(self.output_token_ids) - 1)", "max(0, self.max_tokens - len(self.output_token_ids))",
     ""),
    ("a tenant's own cache share loses to the preset", FAIR,
     "return max(1, math.floor(share * num_blocks)) if share is not None else preset", "return preset", ""),
    ("the rank victim is the oldest among ties", FAIR, "return max(reversed(running), key=self.policy.rank)",
     "return max(running, key=self.policy.rank)", ""),
    # found by a review after the pass: each fixed, then planted back here
    ("reject mode preempts for a better-ranked request", SCH,
     'if self._may_preempt_for is None or self.config.preemption_mode == "reject":',
     "if self._may_preempt_for is None:", ""),
    ("a swap-in checks room for one chunk only", SCH,
     "blocks = kv.num_new_blocks(req, req.num_uncomputed_tokens)", "blocks = kv.num_new_blocks(req, tokens)", ""),
    ("preempting for a swapped request counts only its swapped blocks", KVM,
     "        if _swapped_out(req):\n            start = PrefixHit()",
     "        if _swapped_out(req):\n            return room >= len(req.cpu_block_ids)", ""),
    ("WFQ never hears of a tenant going idle while nothing waits", SCH,
     "            if self._activity is not None:", "            if False:", ""),
    ("a sample without its leader counts misses only", KVM, "elif self.can_fork(req):",
     "elif req.leader is not None and req.num_computed_tokens:", ""),
    ("WFQ charges a recompute's re-prefill as service again", FAIR,
     "first = max(seq.start, req.num_tokens_computed_once)", "first = seq.start", ""),
    ("a forked sample reports no cached tokens", KVM,
     "            req.prefix_lookup_recorded = True\n            req.num_cached_tokens = req.leader.num_cached_tokens",
     "            req.prefix_lookup_recorded = True", ""),
    ("aborting a finished sample aborts it again", ENGINE,
     "            if sample.status.finished:\n                return False", "            if False:\n                return False",
     ""),
    ("a WFQ tenant that trickled rejoins with the credit it banked", FAIR, "        if rejoined:\n",
     "        if False:\n", ""),
    ("a caller's admission leaves the named victim rule ranking by the named one", FAIR,
     "        if isinstance(pre, RankPreemption):", "        if False:", ""),
    # a later pass over the fairness policies alone (tests/test_fairness_mutants.py pins each)
    ("a rejoining WFQ tenant is lifted from the most-served backlogged tenant", FAIR,
     "floor = min(self.counter(u) for u in others) - 2 * self.margin",
     "floor = max(self.counter(u) for u in others) - 2 * self.margin", ""),
    ("WFQ ties go by tenant name, not by queue place", FAIR,
     "heap = [(self.counter(t), ties[t], t) for t in queues]", "heap = [(self.counter(t), t, t) for t in queues]", ""),
    ("caps hold every tenant behind one tenant's head request", FAIR,
     'class CapsAdmission(FCFSAdmission):\n    """FCFS order; a tenant whose head request cannot start does not hold up '
     'other tenants."""\n\n    head_of_line = "tenant"',
     'class CapsAdmission(FCFSAdmission):\n    """FCFS order; a tenant whose head request cannot start does not hold up '
     'other tenants."""\n\n    head_of_line = "global"', ""),
    ("deadlines let other tenants pass a head request that does not fit", FAIR,
     'class DeadlineAdmission(KeepsItsOrder):\n    """Earliest deadline first, with aging: see the module docstring for '
     'the bound."""\n\n    head_of_line = "global"',
     'class DeadlineAdmission(KeepsItsOrder):\n    """Earliest deadline first, with aging: see the module docstring for '
     'the bound."""\n\n    head_of_line = "tenant"', ""),
    # policy code no row reached before (tests/test_three_class_order_and_cache_quotas.py pins each)
    ("three_class leaves batch unsorted in the order of a queue it does not keep", FAIR,
     "if c < 2 or len(kept[0]) < self.threshold:", "if c < 2:", ""),
    ("three_class stops admission at any tenant's head request that does not fit", FAIR,
     'class ThreeClassAdmission(KeepsItsOrder):\n    """Interactive before agent before batch; batch only while the '
     'interactive queue is short."""\n\n    head_of_line = "tenant"',
     'class ThreeClassAdmission(KeepsItsOrder):\n    """Interactive before agent before batch; batch only while the '
     'interactive queue is short."""\n\n    head_of_line = "global"', ""),
    ("blocks cached for every tenant get the three-class tenant quota", FAIR,
     "        if tenant is None:\n            return None\n        share", "        if tenant is None:\n"
     "            return preset\n        share", ""),
    ("a tenant's own cache share rounds down to no block", FAIR,
     "return max(1, math.floor(share * num_blocks)) if share", "return math.floor(share * num_blocks) if share", ""),
    ("WFQ charges a waiting request its cached prefix", FAIR,
     "reached = max(req.num_computed_tokens, req.num_tokens_computed_once, computed_if_admitted)",
     "reached = max(req.num_computed_tokens, req.num_tokens_computed_once)", ""),
    ("a recount charges every holder of a shared partly filled block a copy", KVM,
     "total += min(n, refcount(b) - 1)", "total += n", ""),
    # the room bound for a sample of an n > 1 request (tests/test_sample_room.py pins each)
    ("a waiting sample that can fork preempts without a room bound", SCH,
     "        *_, (left, _) = self.kv.claims_as_they_leave(self.running, cands)\n",
     "        if req.status is RequestStatus.WAITING and self.kv.can_fork(req):\n            return True\n"
     "        *_, (left, _) = self.kv.claims_as_they_leave(self.running, cands)\n", ""),
    ("a forking sample's room bound leaves out the copy of the block it shares", KVM,
     " - len(hit) + (start.num_tokens % self.block_size > 0)", " - len(hit)", ""),
    ("a sample's own leader is a candidate victim for it", SCH,
     "                 and r is not req.leader and self._may_preempt_for(req, r)]",
     "                 and self._may_preempt_for(req, r)]", ""),
    # a hunt in the prefix caches (tests/test_prefix_cache_eviction_queues_quota_pin_and_namespaces.py pins each)
    ("the leaf heap's rebuild swaps tick and order (leaves lost, never evicted)", LEAVES,
     "self._heap = [(tick, seq, leaf) for leaf, (tick, seq) in self._stamp.items()]",
     "self._heap = [(tick, seq, leaf) for leaf, (seq, tick) in self._stamp.items()]", ""),
    ("radix quota eviction pins the first node of the path, not the last", RADIX,
     "path[-1].block_ids[-1] if path else None)", "path[0].block_ids[-1] if path else None)", ""),
    ("an emptied quota group's eviction queue is kept", LEAVES,
     "self.by_namespace.pop(namespace if self.group_of is None else self.group_of(namespace), None)",
     "self.by_namespace.pop(namespace, None)", ""),
    ("the lab-3 cache looks prompts up in the public namespace", LEARNER, "        salt = namespace or None\n",
     "        salt = None\n", ""),
    ("the lab-3 cache's insert goes on past another prefix's key", LEARNER,
     "if entry.tokens != tokens or entry.parent != parent:", "if entry.tokens != tokens:", ""),
]

TESTS = ["tests/test_scheduler_invariants.py", "tests/test_preemption.py", "tests/test_prefix_cache.py",
         "tests/test_prefix_engine.py", "tests/test_prefix_extend.py", "tests/test_reliability.py",
         "tests/test_fairness.py", "tests/test_small_contracts.py", "tests/test_api.py",
         "tests/test_fairness_mutants.py", "tests/test_three_class_order_and_cache_quotas.py",
         "tests/test_wfq_orders_by_what_a_cached_prompt_will_be_charged.py",
         "tests/test_a_forked_group_reserves_one_copy_fewer_than_its_holders.py",
         "tests/test_prefix_cache_eviction_queues_quota_pin_and_namespaces.py", "tests/test_sample_room.py",
         "tests/test_cap_need.py"]


def run_one(name: str, rel: str, old: str, new: str, tests: list[str]) -> tuple[str, str]:
    """Plant one row's bug, run ``tests``, put the file back; (verdict, first failure or last line).

    The text must occur exactly once so a refactor cannot turn a row into a silent no-op (STALE instead);
    ``-x`` because one failing test already kills the mutant, and stopping there keeps a killed row short."""
    path = ROOT / rel
    source = path.read_text()
    if source.count(old) != 1:
        return "STALE", f"the text to replace occurs {source.count(old)} times in {rel}: update this row"
    path.write_text(source.replace(old, new))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                               *tests], cwd=ROOT, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return "KILLED", "timeout (a hang counts as caught)"
    finally:
        path.write_text(source)
    lines = proc.stdout.strip().splitlines()
    first = next((ln for ln in lines if ln.startswith("FAILED")), lines[-1] if lines else "")
    return ("KILLED" if proc.returncode else "SURVIVED"), first


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM's default action ends the process without unwinding, so ``run_one``'s ``finally`` would not run
    and the planted bug would stay in the tree; raised as an exit, it unwinds through the restore (and
    ``subprocess.run`` kills the pytest it was waiting on)."""
    sys.exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="*", type=int, help="row numbers to run (default: all)")
    args = ap.parse_args()
    counts: dict[str, int] = {}
    for i, (name, rel, old, new, note) in enumerate(MUTANTS):
        if args.rows and i not in args.rows:
            continue
        t = time.perf_counter()
        verdict, detail = run_one(name, rel, old, new, TESTS)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"[{i:2}] {verdict:8} {name} ({time.perf_counter() - t:.0f} s) {detail[:150]}", flush=True)
        if verdict == "SURVIVED" and note:
            print(f"     note: {note}", flush=True)
    print(", ".join(f"{n} {v.lower()}" for v, n in sorted(counts.items())))


if __name__ == "__main__":
    main()

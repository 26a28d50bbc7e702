"""Planted bugs, one list per exercise, for testing that each checker catches them.

Each mutant is ``(description, old, new)``: a text patch on the *solution* code
inside the solution region (between the markers) of the exercise cell in
``solutions/``.  ``tests/test_labs.py`` applies every
patch, runs the checker on the result and requires it to fail -- so a checker
that waves through a classic mistake (off-by-one at a block boundary, refcount
not decremented, evicting a locked node...) fails the build.  Patching the
solution text (rather than keeping bug copies by hand) means the mutants
follow the solution when it changes, and a patch that no longer applies fails
loudly.
"""

from __future__ import annotations

MUTANTS: dict[str, list[tuple[str, str, str]]] = {
    "block_pool": [
        ("refcount not decremented on decref", "self.counts[block_id] -= 1\n        if self.counts[block_id] == 0:",
         "if self.counts[block_id] == 1:"),
        ("freed block never returns to the free list", "self.free.append(block_id)\n            return True",
         "return True"),
        ("LIFO: freed block goes to the front", "self.free.append(block_id)", "self.free.appendleft(block_id)"),
        ("no double-free check", 'raise ValueError(f"decref on free block {block_id} (double free)")', "pass"),
        ("allocate leaves the count at 0", "self.counts[block_id] = 1", "self.counts[block_id] += 0"),
        ("empty pool raises IndexError", 'if not self.free:\n            raise OutOfBlocksError("no free KV blocks")\n', ""),
        ("incref on a free block allowed", 'if self.counts[block_id] <= 0:\n            raise ValueError(f"incref',
         'if self.counts[block_id] < 0:\n            raise ValueError(f"incref'),
        ("decref reports a shared block as freed", "return True\n        return False", "return True\n        return True"),
        ("allocate takes from the back", "self.free.popleft()", "self.free.pop()"),
    ],
    "slot_mapping": [
        ("block index and offset swapped", "block_table[p // block_size] * block_size + p % block_size",
         "block_table[p % block_size] * block_size + p // block_size"),
        ("forgets to scale the block id", "block_table[p // block_size] * block_size + p % block_size",
         "block_table[p // block_size] + p % block_size"),
        ("one token too many", "range(start, start + num_tokens)", "range(start, start + num_tokens + 1)"),
        ("positions shifted by one", "range(start, start + num_tokens)", "range(start + 1, start + num_tokens + 1)"),
        ("ignores the block table", "block_table[p // block_size] * block_size + p % block_size", "p"),
        ("offset not taken modulo block_size", "* block_size + p % block_size", "* block_size + p"),
        ("off-by-one block index", "block_table[p // block_size]", "block_table[(p - 1) // block_size]"),
    ],
    "paged_slots": [
        ("floor instead of ceiling", "-(-n // block_size)", "(n // block_size)"),
        ("always one block extra at an exact boundary", "-(-n // block_size)", "(n // block_size + 1)"),
        ("no rounding to blocks", "return sum(-(-n // block_size) * block_size for n in seq_lens)",
         "return sum(seq_lens)"),
        ("max instead of sum", "return sum(", "return max("),
        ("counts blocks, not slots", "* block_size for n", " for n"),
        ("block size hard-coded to 16", "-(-n // block_size) * block_size", "-(-n // 16) * 16"),
    ],
    "split_step": [
        ("first output token counted as prefill", "if start >= prompt_lens[request_id]:",
         "if start > prompt_lens[request_id]:"),
        ("classifies by chunk size", "if start >= prompt_lens[request_id]:", "if num_tokens == 1:"),
        ("counts sequences, not tokens", "prefill += num_tokens", "prefill += 1"),
        ("returns (decode, prefill)", "return prefill, decode", "return decode, prefill"),
        ("last prompt token counted as decode", "if start >= prompt_lens[request_id]:",
         "if start >= prompt_lens[request_id] - 1:"),
    ],
    "static_batching": [
        ("continuous batching (always admits)", "return [] if running else list(waiting)", "return list(waiting)"),
        ("never admits", "return [] if running else list(waiting)", "return []"),
        ("newest first", "return [] if running else list(waiting)", "return [] if running else list(reversed(waiting))"),
        ("one request per batch", "return [] if running else list(waiting)", "return [] if running else list(waiting)[:1]"),
        ("admits while fewer than 2 run", "return [] if running else", "return [] if len(running) > 1 else"),
        ("inverted condition", "return [] if running else list(waiting)", "return list(waiting) if running else []"),
    ],
    "block_hashes": [
        ("no chaining", "parent = hash((parent, block, salt if i == 0 else None))",
         "parent = hash((block, salt if i == 0 else None))"),
        ("partial tail block hashed", "range(len(token_ids) // block_size)", "range(-(-len(token_ids) // block_size))"),
        ("salt ignored", "salt if i == 0 else None", "None"),
        ("last full block dropped", "range(len(token_ids) // block_size)", "range(len(token_ids) // block_size - 1)"),
        ("key depends on the list object", "hash((parent, block, salt if i == 0 else None))",
         "hash((parent, block, salt if i == 0 else None, id(token_ids)))"),
        ("returns unchained keys", "keys.append(parent)", "keys.append(hash(block))"),
    ],
    "match_prefix": [
        ("matches the last token too", "hasher(token_ids[:-1], block_size, salt)", "hasher(token_ids, block_size, salt)"),
        ("skips a miss instead of stopping",
         "if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):\n            break",
         "if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):\n"
         "            parent = key\n            continue"),
        ("no token validation (trusts the key)",
         "if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):",
         "if entry is None:"),
        ("no parent validation", "if entry.parent != parent:", "if False:"),
        ("salt dropped", "hasher(token_ids[:-1], block_size, salt)", "hasher(token_ids[:-1], block_size)"),
        ("drops two tokens", "hasher(token_ids[:-1], block_size, salt)", "hasher(token_ids[:-2], block_size, salt)"),
    ],
    "pick_victim": [
        ("evicts a locked node", 'n["locks"] == 0 and n["children"] == 0', 'n["children"] == 0'),
        ("evicts an inner node", 'n["locks"] == 0 and n["children"] == 0', 'n["locks"] == 0'),
        ("most recently used", "min(candidates", "max(candidates"),
        ("never gives up", "return None", 'return nodes[0]["id"] if nodes else None'),
        ("ties go to the last", "min(candidates, key", "min(list(reversed(candidates)), key"),
        ("first candidate, not LRU", 'min(candidates, key=lambda n: n["last_access"])["id"]', 'candidates[0]["id"]'),
    ],
}

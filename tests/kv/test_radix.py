from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kv.hashing import chain_hashes, root_hash
from deepinfer.kv.radix import DEVICE, HOST, RadixTree

PS = 4


def hashes(tokens, salt=None):
    return chain_hashes(tokens, PS, root_hash("model", salt))


def insert(tree, tokens, pages, salt=None):
    h = hashes(tokens, salt)
    return tree.insert(h, tokens[: len(h) * PS], DEVICE, pages[: len(h)])


def test_match_split_and_dedup():
    tree = RadixTree(PS)
    a = list(range(16))  # 4 pages
    b = list(range(8)) + [99] * 8  # shares 2 pages
    insert(tree, a, [1, 2, 3, 4])
    assert tree.num_nodes() == 1
    m = tree.match(hashes(b))
    assert m.num_pages == 2 and tree.num_nodes() == 2  # split at the junction
    assert m.path[-1].tiers[DEVICE] == [1, 2]
    _, kept = insert(tree, b, [7, 8, 5, 6])
    assert kept == [1, 2, 5, 6]  # first two pages already cached: caller's copies are duplicates
    assert tree.num_nodes() == 3
    assert tree.match(hashes(a)).num_pages == 4
    assert tree.pages_in_tier[DEVICE] == 6


def test_partial_page_never_matched():
    tree = RadixTree(PS)
    insert(tree, list(range(10)), [1, 2])  # 2 full pages, 2 tokens dropped
    assert tree.match(hashes(list(range(10)))).num_pages == 2


def test_lock_protects_and_lru_order():
    tree = RadixTree(PS)
    freed = []
    release = lambda node, tier: freed.extend(node.tiers[tier])
    ma, _ = insert(tree, [1] * 8, [1, 2])
    mb, _ = insert(tree, [2] * 8, [3, 4])
    mc, _ = insert(tree, [3] * 8, [5, 6])
    tree.match(hashes([1] * 8))  # a is now the most recent
    tree.lock(mb.last)
    assert tree.evict(DEVICE, 2, release) == 2
    assert freed == [5, 6]  # c: least recent unlocked (b is locked)
    assert tree.evict(DEVICE, 2, release) == 2
    assert freed == [5, 6, 1, 2]
    assert tree.evict(DEVICE, 2, release) == 0  # only b is left and it is locked
    tree.unlock(mb.last)
    assert tree.evict(DEVICE, 2, release) == 2
    assert tree.num_nodes() == 0


def test_evicts_leaves_before_parents():
    tree = RadixTree(PS)
    order = []
    insert(tree, list(range(8)), [1, 2])
    insert(tree, list(range(8)) + [50] * 4, [1, 2, 3])
    tree.match(hashes(list(range(8))))  # parent touched last, still must go after its child
    tree.evict(DEVICE, 3, lambda n, t: order.append(list(n.tiers[t])))
    assert order == [[3], [1, 2]]


def test_salt_isolation():
    tree = RadixTree(PS)
    toks = list(range(12))
    insert(tree, toks, [1, 2, 3], salt="tenant-a")
    assert tree.match(hashes(toks, "tenant-b")).num_pages == 0
    assert tree.match(hashes(toks)).num_pages == 0
    assert tree.match(hashes(toks, "tenant-a")).num_pages == 3


def test_dropping_a_tier_keeps_node_in_lower_tier_and_subtree_goes_with_last_tier():
    tree = RadixTree(PS)
    m, _ = insert(tree, list(range(8)), [1, 2])
    tree.add_tier(m.last, HOST, [10, 11])
    tree.evict(DEVICE, 2, lambda n, t: None)
    node = tree.match(hashes(list(range(8)))).last
    assert node.tiers[DEVICE] is None and node.tiers[HOST] == [10, 11]
    released = []
    tree.evict(HOST, 2, lambda n, t: released.append((t, list(n.tiers[t]))))
    assert released == [(HOST, [10, 11])] and tree.num_nodes() == 0


def test_max_node_pages_caps_node_length():
    tree = RadixTree(PS, max_node_pages=2)
    insert(tree, list(range(20)), [1, 2, 3, 4, 5])
    assert tree.num_nodes() == 3


def test_insert_below_a_node_continues_its_chain():
    """A growing sequence inserts only its new pages below the node it owns; the result is the
    tree a full insert makes, the whole path's LRU age is refreshed and existing pages dedup."""
    toks = list(range(24))  # 6 pages
    h = hashes(toks)
    whole = RadixTree(PS, max_node_pages=2)
    whole.insert(h, toks, DEVICE, [1, 2, 3, 4, 5, 6])
    tree = RadixTree(PS, max_node_pages=2)
    m, _ = tree.insert(h[:3], toks[:12], DEVICE, [1, 2, 3])
    m2, kept = tree.insert(h[3:], toks[12:], DEVICE, [4, 5, 6], below=m.last)
    assert kept == [4, 5, 6] and m2.num_pages == 3 and m2.path[0].parent is m.last
    assert tree.num_nodes() == 4  # 2 + 1 pages, then 2 + 1 below: the cap applies per insert
    assert tree.match(h).num_pages == 6 and whole.match(h).num_pages == 6
    assert all(n.last_access == m2.path[-1].last_access for n in tree.match(h, touch=False).path)
    other = tree.insert(h[3:], toks[12:], DEVICE, [7, 8, 9], below=m.last)[1]
    assert other == [4, 5, 6]  # already there: the tree's pages win
    assert tree.pages_in_tier[DEVICE] == 6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=24), min_size=1, max_size=12),
       st.integers(1, 6))
def test_matches_naive_reference_without_eviction(seqs, cap):
    tree = RadixTree(PS, max_node_pages=cap)
    seen: set[tuple[int, ...]] = set()
    next_page = iter(range(1, 10_000))
    for toks in seqs:
        full = len(toks) // PS
        # ``seen`` holds every cached page prefix, so it is closed under taking prefixes
        expect = max(p for p in range(full + 1) if p == 0 or tuple(toks[: p * PS]) in seen)
        assert tree.match(hashes(toks)).num_pages == expect
        insert(tree, toks, [next(next_page) for _ in range(full)])
        for p in range(1, full + 1):
            seen.add(tuple(toks[: p * PS]))
    assert tree.pages_in_tier[DEVICE] == len(seen)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=4, max_size=20), st.booleans()),
                min_size=1, max_size=15), st.integers(1, 8))
def test_eviction_invariants(ops, budget):
    """Under eviction pressure: locked pages survive, every page is freed once, counts agree."""
    tree = RadixTree(PS, max_node_pages=2)
    live, freed = set(), []
    locks = []
    next_page = iter(range(1, 10_000))
    for toks, lock in ops:
        full = len(toks) // PS
        pages = [next(next_page) for _ in range(full)]
        m, kept = insert(tree, toks, pages)
        live |= set(kept)
        for p in pages:
            if p not in kept:
                freed.append(p)
        if lock:
            tree.lock(m.last)
            locks.append(m.last)
        over = tree.pages_in_tier[DEVICE] - budget
        if over > 0:
            tree.evict(DEVICE, over, lambda n, t: freed.extend(n.tiers[t]))
        for node in locks:
            n = node
            while n is not tree.root:
                assert n.tiers[DEVICE] is not None
                n = n.parent
    assert len(freed) == len(set(freed))
    in_tree = []
    stack = [tree.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n is not tree.root and n.tiers[DEVICE] is not None:
            in_tree += n.tiers[DEVICE]
    assert len(in_tree) == tree.pages_in_tier[DEVICE]
    assert set(in_tree).isdisjoint(freed)

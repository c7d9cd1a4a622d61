"""A radix tree over token ids: which stored sequences share the longest prefix with a prompt.

Pure Python, no MLX. Each stored sequence has a key (its entry id); edges hold runs of
tokens, nodes sit where sequences end or branch. Three stored sequences:

    a = [1, 2, 3, 4]    b = [1, 2, 3, 9, 9]    c = [1, 7]

    root -(1)-> n1 -(2, 3)-> n2 -(4)-> [a]
                 |            `-(9, 9)-> [b]
                 `-(7)-> [c]

``matches([1, 2, 3, 9, 5])`` walks 1, 2, 3, 9 (mid-edge: the prompt leaves b's edge after
one token) and yields groups by common-prefix length, longest first: (4, [b]) — b shares
4 tokens — then (3, [a]) and (1, [c]).

    >>> ix = RadixIndex()
    >>> for key, seq in (("a", [1, 2, 3, 4]), ("b", [1, 2, 3, 9, 9]), ("c", [1, 7])):
    ...     ix.add(key, seq)
    >>> list(ix.matches([1, 2, 3, 9, 5]))
    [(4, ['b']), (3, ['a']), (1, ['c'])]
    >>> ix.prefixes_of([1, 2, 3, 4, 5]), sorted(ix.extensions_of([1, 2])), ix.shared([1, 2, 3, 9, 5])
    (['a'], ['a', 'b'], 4)
    >>> ix.remove("a"); list(ix.matches([1, 2, 3, 4]))
    [(3, ['b']), (1, ['c'])]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class _Node:
    __slots__ = ("edge", "children", "key", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None):
        self.edge = edge  # tokens from the parent to this node
        self.children: dict[int, _Node] = {}  # first token of the child's edge -> child
        self.key: str | None = None  # the sequence that ends here, if any
        self.parent = parent


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixIndex:
    """Keys of token sequences, one key per distinct sequence."""

    def __init__(self):
        self._root = _Node((), None)
        self._ends: dict[str, _Node] = {}  # key -> the node where its sequence ends
        self._tokens: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._ends)

    def __contains__(self, key: str) -> bool:
        return key in self._ends

    def keys(self) -> list[str]:
        return list(self._ends)

    def tokens(self, key: str) -> tuple[int, ...]:
        return self._tokens[key]

    def key_of(self, tokens: Sequence[int]) -> str | None:
        """The key stored for exactly these tokens, if any."""
        node, depth, at = self._walk(tokens)
        return node.key if at == len(node.edge) and depth == len(tokens) else None

    def _walk(self, tokens: Sequence[int]) -> tuple[_Node, int, int]:
        """Follow ``tokens`` as far as they match: (node, tokens matched, tokens matched on
        the node's edge). ``at < len(node.edge)`` means the walk stopped inside the edge."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                return node, depth, len(node.edge)
            at = _common(child.edge, tokens[depth:depth + len(child.edge)])
            depth += at
            node = child
            if at < len(child.edge):
                return node, depth, at
        return node, depth, len(node.edge)

    def add(self, key: str, tokens: Sequence[int]) -> None:
        """Store ``tokens`` under ``key``; a sequence already stored under another key, or a
        key already in use, is a ``ValueError``."""
        tokens = tuple(tokens)
        if key in self._ends:
            raise ValueError(f"key {key} is already stored")
        node, depth, at = self._walk(tokens)
        if at < len(node.edge):
            node = self._split(node, at)
        if depth < len(tokens):
            child = _Node(tokens[depth:], node)
            node.children[tokens[depth]] = child
            node = child
        if node.key is not None:
            raise ValueError(f"these tokens are already stored as {node.key}")
        node.key = key
        self._ends[key] = node
        self._tokens[key] = tokens

    def _split(self, node: _Node, at: int) -> _Node:
        """Insert a node ``at`` tokens down ``node``'s edge; returns the new middle node."""
        parent = node.parent
        middle = _Node(node.edge[:at], parent)
        parent.children[middle.edge[0]] = middle
        node.edge = node.edge[at:]
        node.parent = middle
        middle.children[node.edge[0]] = node
        return middle

    def remove(self, key: str) -> None:
        """Forget ``key``; nodes left without a purpose are removed or merged."""
        node = self._ends.pop(key)
        del self._tokens[key]
        node.key = None
        while node is not self._root and node.key is None and len(node.children) <= 1:
            parent = node.parent
            if node.children:  # one child: fold this node into it
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[node.edge[0]] = child
                return
            del parent.children[node.edge[0]]
            node = parent

    def _subtree_keys(self, node: _Node, skip: _Node | None = None) -> list[str]:
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            if n is skip:
                continue
            if n.key is not None:
                out.append(n.key)
            stack.extend(n.children.values())
        return out

    def matches(self, tokens: Sequence[int]) -> Iterator[tuple[int, list[str]]]:
        """(common-prefix length, keys) groups, longest first; every stored key with a
        common prefix of at least one token appears in exactly one group."""
        node, depth, at = self._walk(tokens)
        if depth and node is not self._root:
            yield depth, self._subtree_keys(node)
        depth -= at
        below = node
        node = node.parent
        while node is not None and node is not self._root:
            keys = self._subtree_keys(node, skip=below)
            if keys:
                yield depth, keys
            depth -= len(node.edge)
            below, node = node, node.parent

    def shared(self, tokens: Sequence[int]) -> int:
        """The longest prefix of ``tokens`` that some stored sequence starts with."""
        return self._walk(tokens)[1]

    def prefixes_of(self, tokens: Sequence[int]) -> list[str]:
        """Keys whose sequence is a prefix of ``tokens`` (``tokens`` itself included), shortest first."""
        out, node, depth = [], self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or tuple(tokens[depth:depth + len(child.edge)]) != child.edge:
                break
            node, depth = child, depth + len(child.edge)
            if node.key is not None:
                out.append(node.key)
        return out

    def extensions_of(self, tokens: Sequence[int]) -> list[str]:
        """Keys whose sequence starts with ``tokens`` (``tokens`` itself included)."""
        node, depth, _ = self._walk(tokens)
        return self._subtree_keys(node) if depth == len(tokens) and tokens else []

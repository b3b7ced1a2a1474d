"""A step's small captures packed into bundles: the sender's half of the wire's bundle format.

    b = Bundler(run=b"r1", seqs={})
    b.entry(key, ident, dtype, hidden, n, tokens, data, nbytes, sent_ns)  # one capture with its own header
    b.group(ident, dtype, hidden, n, tokens, nbytes, [(key, data), ...], sent_ns)  # captures sharing the rows
    for buf, meta in b.take(): publisher.send_bundle(buf, meta)        # meta: (site, payload bytes, seq) each

A bundle is at most `BUNDLE_MAX` bytes (one capture may exceed it alone): a capture that does not
fit seals the bundle and starts the next, and a group that does not fit is split into two. This
runs on the model's thread at a step's end, from caches the model's layers have just flushed: a
group that fits is packed as a list of parts and appended with one join (a pack per capture, one
copy of its bytes); one that does not, or one that fails, goes member by member (`_group_each`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._wire import (
    BUNDLE_MAX,
    BUNDLE_TOPIC,
    LENGTH,
    MAGIC,
    VERSION,
    PerSite,
    close_group,
    entry_struct,
    group_struct,
    member_struct,
)

if TYPE_CHECKING:
    from ._identity import StepIdentity
    from ._sites import SiteKey

Meta = list[tuple[bytes, int, int]]


class Bundler:
    def __init__(self, run: bytes, seqs: dict[bytes, int]) -> None:
        self.run = run
        self.seqs = seqs  # per site: captures staged so far (the next one's seq), shared with the large captures
        self.buf = bytearray(BUNDLE_TOPIC)
        self.meta: Meta = []  # per capture in `buf`: site, payload bytes, seq
        self.sealed: list[tuple[bytearray, Meta]] = []  # full bundles of this step
        self._entry = PerSite(lambda topic: entry_struct(len(topic), len(run)))  # the start of a site's entries
        self._member = PerSite(lambda topic: member_struct(len(topic)))  # the start of a site's group members
        self._group = group_struct(len(run))

    @property
    def queued(self) -> int:
        return len(self.meta) + sum(len(m) for _, m in self.sealed)

    def take(self) -> list[tuple[bytearray, Meta]]:
        """The step's bundles, in order; the bundler starts empty again."""
        bundles, self.sealed = self.sealed, []
        if self.meta:
            bundles.append((self.buf, self.meta))
            self.buf, self.meta = bytearray(BUNDLE_TOPIC), []
        return bundles

    def _seal(self) -> bytearray:
        self.sealed.append((self.buf, self.meta))
        self.buf, self.meta = bytearray(BUNDLE_TOPIC), []
        return self.buf

    def entry(self, key: SiteKey, ident: StepIdentity, dtype: int, hidden: int, n: int, tokens: bytes,
              data: object, nbytes: int, sent_ns: int) -> None:
        """Append one capture as a frame 0 of its own (header, tokens, payload)."""
        topic = key.topic
        entry = self._entry[topic]
        size = entry.size - LENGTH.size + len(tokens) + nbytes
        buf = self.buf
        if self.meta and len(buf) + size > BUNDLE_MAX:
            buf = self._seal()
        seq = self.seqs.get(topic, 0)
        self.seqs[topic] = seq + 1
        # One pack writes the entry's length, the site, the header and the run id (encode_head's layout).
        buf += entry.pack(size, topic, MAGIC, VERSION, ident.phase, dtype, ident.step, key.layer, hidden, n,
                          len(self.run), len(topic), seq, sent_ns, self.run)
        buf += tokens
        buf += data  # type: ignore[operator]
        self.meta.append((topic, nbytes, seq))

    def group(self, ident: StepIdentity, dtype: int, hidden: int, n: int, tokens: bytes, nbytes: int,
              members: list[tuple[SiteKey, object]], sent_ns: int) -> int:
        """Append captures of one step that share its rows, dtype and width as a group (one header, the token
        ids once). Returns how many went in: all of them, unless a member's bytes could not be appended, which
        leaves the bundle well-formed without it and the rest, and is raised again as `GroupError(written)`."""
        head, run, seqs, structs = self._group, self.run, self.seqs, self._member
        added: Meta = []
        try:
            size = head.size + len(tokens)
            for key, _ in members:
                size += structs[key.topic].size + nbytes
            if len(self.buf) + size <= BUNDLE_MAX:  # the common case: the whole group in one join and one append
                parts = [head.pack(size - LENGTH.size, MAGIC, VERSION, ident.phase, dtype, ident.step, hidden, n,
                                   len(run), len(members), sent_ns, run), tokens]
                for key, data in members:
                    topic = key.topic
                    seq = seqs.get(topic, 0)
                    seqs[topic] = seq + 1
                    added.append((topic, nbytes, seq))
                    parts += (structs[topic].pack(len(topic), topic, seq), data)
                self.buf += b"".join(parts)  # one copy: appending each part reallocated the growing bundle
                self.meta += added
                return len(members)
        except Exception:
            for topic, _, seq in reversed(added):  # nothing went in: the careful path finds what fails, and where
                seqs[topic] = seq
        return self._group_each(ident, dtype, hidden, n, tokens, nbytes, members, sent_ns)

    def _group_each(self, ident: StepIdentity, dtype: int, hidden: int, n: int, tokens: bytes, nbytes: int,
                    members: list[tuple[SiteKey, object]], sent_ns: int) -> int:
        """`group` member by member, opening a new bundle wherever one fills up."""
        head, run, seqs, structs = self._group, self.run, self.seqs, self._member
        buf, meta = self.buf, self.meta
        start, count, written = -1, 0, 0
        try:
            for key, data in members:
                topic = key.topic
                m = structs[topic]
                size = m.size + nbytes
                if start < 0 or len(buf) + size > BUNDLE_MAX:  # (re)open the group, in a new bundle if full
                    if start >= 0:
                        close_group(buf, start, count)
                    if meta and len(buf) + head.size + len(tokens) + size > BUNDLE_MAX:
                        buf = self._seal()
                        meta = self.meta
                    start, count = len(buf), 0
                    buf += head.pack(0, MAGIC, VERSION, ident.phase, dtype, ident.step, hidden, n, len(run), 0,
                                     sent_ns, run)
                    buf += tokens
                seq = seqs.get(topic, 0)
                at = len(buf)
                try:
                    buf += m.pack(len(topic), topic, seq)
                    buf += data  # type: ignore[operator]
                except BaseException:
                    del buf[at:]  # the member's part: the group stays whole without it
                    raise
                seqs[topic] = seq + 1
                meta.append((topic, nbytes, seq))
                count += 1
                written += 1
        except Exception as exc:
            self._end_group(buf, start, count)
            raise GroupError(written) from exc
        except BaseException:  # KeyboardInterrupt and the like: the bundle stays well-formed, and it goes on up
            self._end_group(buf, start, count)
            raise
        self._end_group(buf, start, count)
        return written

    @staticmethod
    def _end_group(buf: bytearray, start: int, count: int) -> None:
        if start < 0:
            return
        if count:
            close_group(buf, start, count)
        else:  # nothing went in: no empty group on the wire
            del buf[start:]


class GroupError(Exception):
    """`Bundler.group` failed after `written` of its members went in (the cause is chained)."""

    def __init__(self, written: int) -> None:
        super().__init__(f"a group failed after {written} members")
        self.written = written

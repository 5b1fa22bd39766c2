"""A replica's old lease, once etcd answers again, is revoked even when the first tries find no
member: until it is, its keys hold every campaign (a 30 s etcd outage test waited 4 s for them)."""

import asyncio

from muster.coordinator.replica.campaigns import revoked


class OldSession:
    """A lease whose revoke etcd answers from the `answers_from`-th try on (LeaseSession.revoke's
    contract: False while etcd does not answer)."""

    def __init__(self, answers_from: int):
        self.answers_from, self.tries = answers_from, 0

    def revoke(self) -> bool:
        self.tries += 1
        return self.tries >= self.answers_from


def test_the_revoke_is_tried_again_until_etcd_answers():
    old = OldSession(answers_from=3)
    assert asyncio.run(revoked(old, within_s=5.0)) and old.tries == 3


def test_tries_end_when_the_lease_would_have_expired_anyway():
    old = OldSession(answers_from=10**9)
    assert not asyncio.run(revoked(old, within_s=0.3)) and old.tries > 1

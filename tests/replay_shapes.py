"""Replay answers in the shape vLLM sent before vllm-project/vllm#45177 put the topic in
(its `_service_replay` sent `(client_id, b"", seq, buf)`, then `(client_id, b"", END_SEQ,
b"")`): the DEALER gets 3 frames, not 0.32's 4. Mixed into a simulator publisher by the
tests that hold the subscriber and the capture to both shapes."""

from __future__ import annotations

from engines.sim.events_pub import END_SEQ, EventPublisher
from indexer.subscriber import seq_bytes


class TopiclessReplay(EventPublisher):
    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            client, _, start = await self._replay.recv_multipart()
            for seq, payload in self.buffered(int.from_bytes(start, "big")):
                await self._replay.send_multipart((client, b"", seq_bytes(seq), payload))
            await self._replay.send_multipart((client, b"", END_SEQ, b""))

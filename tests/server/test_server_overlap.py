"""The server with overlap scheduling on: concurrent streams get the very text the offline API
gives with it off, and a client hanging up mid-stream gives every page back."""

import asyncio

import openai
import torch
from hang_up import hang_up_mid_stream
from server_helpers import make_engine, no_lower_tiers, start_server, wait_idle

from deepinfer.sampling_params import SamplingParams


def test_streams_match_offline_and_a_disconnect_frees_its_pages(tiny_llama):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (14 + i,), generator=g).tolist() for i in range(6)]
    kinds = [dict(temperature=0.0), dict(temperature=0.9, seed=5)]
    offline = make_engine(tiny_llama, **no_lower_tiers())
    want = [offline.run_to_completion(
        [offline.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True, **k))])[0].text
        for p in prompts for k in kinds]
    srv = start_server(tiny_llama, engine_kw=dict(overlap_schedule=True, **no_lower_tiers()))
    try:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)
        model = srv.server_obj.model_name

        async def one(prompt, kind) -> str:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=10, stream=True,
                temperature=kind["temperature"], seed=kind.get("seed"),
                extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def main():  # the one hanging up does so with a step in flight
            return await asyncio.gather(hang_up_mid_stream(client, model, 300),
                                        *(one(p, k) for p in prompts for k in kinds))

        _, *got = asyncio.run(main())
        assert got == want
        wait_idle(srv)
    finally:
        srv.stop()

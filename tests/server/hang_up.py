"""A client that hangs up mid-stream: what the disconnect tests share."""

import openai


async def hang_up_mid_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int,
                             after: int = 3) -> int:
    """Stream a long completion, read ``after`` chunks, then close the connection while the
    request still runs; returns the chunks read."""
    stream = await client.completions.create(
        model=model, prompt=list(range(40, 140)), max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    got = 0
    async for _ in stream:
        got += 1
        if got == after:
            break
    await stream.close()  # hang up mid-stream
    return got

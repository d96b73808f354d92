"""Where regeneration through `blockdraft serve` loses time: the same prompts answered by the
offline loop (`answer_prompts`), by the server's scheduler stepped from the main thread, and by
the scheduler stepped from a second thread (as the server runs it), no HTTP anywhere; rounds
interleaved.

    .venv/bin/python benchmarks/scheduler_thread.py [--prompts 128] [--max-new-tokens 200] [--rounds 2]
"""

import argparse
import itertools
import threading
import time

from blockdraft import Engine
from blockdraft.serve.scheduler import Scheduler
from blockdraft.train.data import training_prompts
from blockdraft.train.regen import answer_prompts


def scheduler_rate(engine, prompts, max_new: int, rows: int, thread: bool) -> float:
    sched = Scheduler(engine, method="ar", max_batch=rows, max_queue=len(prompts), max_model_len=256 + max_new)
    handles = [sched.submit(engine.make_row(p["prompt_ids"], max_new), lambda h: None) for p in prompts]

    def work():  # the scheduler thread's loop, without its waiting on the condition variable
        while not all(h.done for h in handles):
            with sched.cond:
                admit = []
                while sched.waiting and len(admit) < len(sched.loop.free_slots):
                    admit.append(sched.waiting.popleft())
            sched._advance(admit)

    t0 = time.perf_counter()
    if thread:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    else:
        work()
    return sum(len(h.state.output_ids) for h in handles) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    engine = Engine.load(use_draft=False)
    prompts = list(itertools.islice(training_prompts(engine.tokenizer, None, 256), 200, 200 + args.prompts))
    for r in range(args.rounds):
        t0 = time.perf_counter()
        stats = answer_prompts(engine, iter(prompts), max_new_tokens=args.max_new_tokens, batch_size=args.rows)
        print(f"offline loop: {stats.tokens / (time.perf_counter() - t0):.0f} answer tok/s", flush=True)
        for thread in (True, False) if r % 2 else (False, True):
            rate = scheduler_rate(engine, prompts, args.max_new_tokens, args.rows, thread)
            print(f"scheduler on the {'second' if thread else 'main'} thread: {rate:.0f} answer tok/s", flush=True)


if __name__ == "__main__":
    main()

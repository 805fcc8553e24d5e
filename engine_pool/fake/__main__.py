"""``python -m engine_pool.fake`` (``engine_pool.fake.serve.main``)."""

from engine_pool.fake.serve import main

if __name__ == "__main__":
    raise SystemExit(main())

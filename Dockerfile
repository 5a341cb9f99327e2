# kvtier's container image: the same build as README's `make`, in two stages
# on Debian 12. Binaries: kvtier-store, kvtier-router, kvtier-sim-worker,
# kvctl, kvtier-bench, kvtier-frontend, kvtier-text. Runs as uid 10001 (the
# Helm chart's default). The frontend's tokenizer crate is built with the Rust
# toolchain scripts/setup.sh installs (rustup) and linked statically.
FROM debian:bookworm AS build
WORKDIR /src
COPY . .
RUN apt-get update && bash scripts/setup.sh \
 && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTIER_ENABLE_CUDA=OFF \
 && cmake --build build

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 librocksdb7.8 libucx0 ucx-utils libxxhash0 libzmq5 libmsgpackc2 libjemalloc2 \
      libabsl20220623 libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --no-create-home kvtier
COPY --from=build /src/build/cachestore/kvtier-store /src/build/router/kvtier-router \
     /src/build/worker/kvtier-sim-worker /src/build/cli/kvctl /src/build/bench/kvtier-bench \
     /src/build/frontend/kvtier-frontend /src/build/frontend/kvtier-text \
     /usr/local/bin/
USER 10001
EXPOSE 7400 7401 7500 8000 9400 9500
ENTRYPOINT []
CMD ["kvtier-store", "--help"]

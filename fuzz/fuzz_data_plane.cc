// libFuzzer: the store's socket data plane (common/data_wire.h) as a client
// may drive it. A real Store, StoreService and SocketDataPlane on 127.0.0.1
// hold one put lease (two reserved slots) and one get lease (a pinned
// block); each input becomes one connection's frames: gets and puts at
// addresses near those slots, the arena's edges, or anywhere, with lengths
// and leases chosen by the input, real or forged sessions, calls, and raw
// bytes. The store must answer or close, never crash, and no byte of its
// arena outside the put lease's slots may change.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cachestore/service.h"
#include "cachestore/socket_dataplane.h"
#include "cachestore/store.h"
#include "common/checksum.h"
#include "common/data_hello.h"
#include "common/data_wire.h"
#include "common/log.h"
#include "common/rpc/proto_convert.h"
#include "common/socket_io.h"
#include "fuzz/fuzz_store.h"

namespace {

using kvtier::wire::Frame;

struct Fixture {
  std::unique_ptr<kvtier::store::Store> store;
  std::unique_ptr<kvtier::store::SocketDataPlane> plane;
  std::unique_ptr<kvtier::store::StoreService> service;
  std::string session;
  int port = 0;
  uint64_t base = 0, size = 0, block = 0;
  uint64_t put_lease = 0, get_lease = 0;
  std::vector<uint64_t> put_slots, get_slots;  // addresses
  std::vector<uint8_t> snapshot;               // the arena, put slots aside

  Fixture() {
    store =
        kvtier::fuzz::OpenScratchStore("kvtier-fuzz-dp", 3600 * 1000);  // leases outlive the run
    // One event loop: coverage then follows the input, not which of
    // several loops took the connection.
    kvtier::store::SocketDataPlane::Options options;
    options.threads = 1;
    plane = std::move(*kvtier::store::SocketDataPlane::Start("127.0.0.1:0", options));
    service = std::make_unique<kvtier::store::StoreService>(store.get(), nullptr, plane.get());
    port = std::stoi(plane->address().substr(plane->address().rfind(':') + 1));
    kvtier::NamespaceSpec spec{"fuzz", "fp16", 1, 1, 8, 16, 0, 1, "", "", ""};
    const uint64_t ns = store->RegisterNamespace(spec, 0)->id;
    const std::string bytes(kvtier::BlockBytes(spec), 'k');
    block = bytes.size();
    (void)store->PutInline(ns, kvtier::BlockHash{1, 1}, bytes,
                           kvtier::Checksum(bytes.data(), bytes.size()));
    grpc::ServerContext c1, c2, c3;
    kvtier::v1::ConnectDataPlaneRequest creq;
    kvtier::v1::ConnectDataPlaneResponse cresp;
    if (!service->ConnectDataPlane(&c1, &creq, &cresp).ok()) std::abort();
    session = cresp.session();
    base = cresp.regions(0).base_addr();
    size = cresp.regions(0).length();
    kvtier::v1::BeginPutRequest preq;
    preq.set_namespace_id(ns);
    kvtier::ToProto(kvtier::BlockHash{2, 2}, preq.add_hashes());
    kvtier::ToProto(kvtier::BlockHash{3, 3}, preq.add_hashes());
    kvtier::v1::BeginPutResponse presp;
    if (!service->BeginPut(&c2, &preq, &presp).ok()) std::abort();
    put_lease = presp.lease_id();
    for (const auto& t : presp.targets()) put_slots.push_back(t.remote_addr());
    kvtier::v1::BeginGetRequest greq;
    greq.set_namespace_id(ns);
    kvtier::ToProto(kvtier::BlockHash{1, 1}, greq.add_hashes());
    kvtier::v1::BeginGetResponse gresp;
    if (!service->BeginGet(&c3, &greq, &gresp).ok() || gresp.sources_size() != 1) std::abort();
    get_lease = gresp.lease_id();
    get_slots.push_back(gresp.sources(0).remote_addr());
    snapshot = Arena();
  }
  // Whether the arena, put slots aside, still holds the snapshot's bytes.
  bool Unchanged() const {
    const auto* a = reinterpret_cast<const uint8_t*>(store->ram().arena().base());
    std::vector<uint64_t> skip;
    for (uint64_t s : put_slots) skip.push_back(s - reinterpret_cast<uint64_t>(a));
    std::sort(skip.begin(), skip.end());
    uint64_t at = 0;
    for (uint64_t s : skip) {
      if (std::memcmp(a + at, snapshot.data() + at, s - at) != 0) return false;
      at = s + block;
    }
    return std::memcmp(a + at, snapshot.data() + at, snapshot.size() - at) == 0;
  }
  // The arena's bytes, with the put slots zeroed (they may take any bytes).
  std::vector<uint8_t> Arena() const {
    const auto* a = reinterpret_cast<const uint8_t*>(store->ram().arena().base());
    std::vector<uint8_t> v(a, a + store->ram().arena().size());
    for (uint64_t s : put_slots) {
      std::memset(v.data() + (s - reinterpret_cast<uint64_t>(a)), 0, block);
    }
    return v;
  }
};

// Reads little-endian bytes from the input, zero past its end.
struct Input {
  const uint8_t* p;
  size_t n;
  uint64_t Take(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      v |= uint64_t{n > 0 ? *p : uint8_t{0}} << (8 * i);
      if (n > 0) ++p, --n;
    }
    return v;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* f = new Fixture();
  if (size < 1) return 0;
  Input in{data, size};
  std::string wire;
  auto frame = [&](const Frame& fr) {
    wire.append(reinterpret_cast<const char*>(&fr), sizeof(fr));
  };
  const uint8_t mode = static_cast<uint8_t>(in.Take(1));
  // The hello goes in front once the store's challenge is read: real (its
  // proof for the nonce) or forged, with or without its frame.
  const bool forged = (mode & 1) != 0;
  const bool hello_frame = (mode & 6) != 6;
  for (int frames = 0; frames < 24 && in.n > 0; ++frames) {
    const uint8_t kind = static_cast<uint8_t>(in.Take(1));
    const uint8_t sel = static_cast<uint8_t>(in.Take(1));
    const uint64_t leases[4] = {f->put_lease, f->get_lease, 0, 0};
    uint64_t lease = (sel & 3) == 3 ? in.Take(8) : leases[sel & 3];
    const uint64_t anchors[4] = {f->put_slots[sel >> 2 & 1], f->get_slots[0],
                                 (sel & 16) ? f->base + f->size : f->base, 0};
    const int64_t delta = static_cast<int16_t>(in.Take(2));
    uint64_t addr = ((sel >> 5 & 3) == 3 ? in.Take(8) : anchors[sel >> 5 & 3]) + delta;
    uint64_t length = (kind & 0x80) ? in.Take(8) : in.Take(2);
    Frame fr{kvtier::wire::kFrameMagic, 0, 0, lease, addr, length};
    switch (kind & 7) {
      case 0:
      case 1:
        fr.op = kvtier::wire::kGet;
        frame(fr);
        break;
      case 2:
      case 3: {
        fr.op = kvtier::wire::kPut;
        frame(fr);
        const size_t payload = static_cast<size_t>(std::min<uint64_t>(length, in.n));
        wire.append(reinterpret_cast<const char*>(in.p), payload);
        in.p += payload;
        in.n -= payload;
        break;
      }
      case 4: {  // a call (no handler answers more than its status here)
        fr.op = kvtier::wire::kCall;
        fr.method = static_cast<uint16_t>(sel);
        fr.length = std::min<uint64_t>(length & 0xff, in.n);
        frame(fr);
        wire.append(reinterpret_cast<const char*>(in.p), fr.length);
        in.p += fr.length;
        in.n -= fr.length;
        break;
      }
      case 5:  // another op or magic
        fr.op = static_cast<uint16_t>(in.Take(2));
        fr.magic ^= static_cast<uint32_t>(sel & 1);
        frame(fr);
        break;
      default: {  // raw bytes
        const size_t k = std::min<size_t>(sel, in.n);
        wire.append(reinterpret_cast<const char*>(in.p), k);
        in.p += k;
        in.n -= k;
      }
    }
  }
  auto fd = kvtier::net::Connect("127.0.0.1", f->port,
                                 std::chrono::steady_clock::now() + std::chrono::seconds(5));
  if (!fd.ok()) __builtin_trap();  // the store stopped listening
  {
    Frame hello{kvtier::wire::kFrameMagic, kvtier::wire::kHello, 0, 0, 0,
                kvtier::wire::kHelloBytes};
    kvtier::wire::Reply challenge;
    std::string nonce(kvtier::wire::kNonceBytes, '\0');
    const auto by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    if (!kvtier::net::ReadAll(*fd, &challenge, sizeof(challenge), by).ok() ||
        challenge.magic != kvtier::wire::kChallengeMagic ||
        !kvtier::net::ReadAll(*fd, nonce.data(), nonce.size(), by).ok()) {
      __builtin_trap();  // every connection starts with a challenge
    }
    std::string front = hello_frame
                            ? std::string(reinterpret_cast<const char*>(&hello), sizeof(hello))
                            : std::string();
    front += forged ? std::string(kvtier::wire::kHelloBytes, static_cast<char>(mode))
                    : kvtier::wire::HelloPayload(f->session, nonce);
    wire = front + wire;
  }
  // Write and read together (the answers may exceed the socket's buffer),
  // until the store has answered everything and closed, or closed early.
  size_t sent = 0;
  bool half_closed = false;
  char buf[65536];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    if (sent == wire.size() && !half_closed) {
      shutdown(*fd, SHUT_WR);
      half_closed = true;
    }
    pollfd p{*fd, static_cast<short>(POLLIN | (half_closed ? 0 : POLLOUT)), 0};
    if (std::chrono::steady_clock::now() > deadline) __builtin_trap();  // the store hung
    if (poll(&p, 1, 100) <= 0) continue;
    if (p.revents & POLLOUT) {
      const ssize_t w = send(*fd, wire.data() + sent, wire.size() - sent, MSG_NOSIGNAL);
      if (w > 0) sent += static_cast<size_t>(w);
      if (w < 0 && errno != EAGAIN) half_closed = true;  // the store closed: read what it said
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t r = recv(*fd, buf, sizeof(buf), 0);
      if (r == 0 || (r < 0 && errno != EAGAIN)) break;
    }
  }
  close(*fd);
  // Nothing outside the put lease's slots changed.
  if (!f->Unchanged()) __builtin_trap();
  return 0;
}

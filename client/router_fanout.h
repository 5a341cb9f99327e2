// A source's events to every router replica: each --router target
// (HOST:PORT) is resolved to all its addresses (a headless Service's name
// resolves to one per replica), and each address gets an EventPublisher of
// its own. Names are resolved again every refresh_ms: a replica that
// appears gets a publisher, seeded with every block held (so its snapshot
// request is answered in full), and one that is gone has its publisher
// stopped. A name that fails to resolve keeps the addresses it had.
// Thread-safe.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "client/router_client.h"

namespace kvtier {

class RouterFanout : public BlockEventSink {
 public:
  // base: the publishers' options but for `router`, which each gets from
  // its address. refresh_ms 0: resolve once.
  RouterFanout(std::vector<std::string> targets, PublisherOptions base,
               EventPublisher::LoadFn load = nullptr, uint64_t refresh_ms = 5000);
  ~RouterFanout() override;

  void Stored(uint64_t ns, const std::vector<BlockHash>& hashes) override;
  void Removed(uint64_t ns, const std::vector<BlockHash>& hashes) override;
  void Cleared() override;
  // Stops every publisher and the refresh.
  void Stop();

  // The addresses with a publisher now, sorted.
  std::vector<std::string> Addresses() const;
  // Every address of HOST:PORT (IPv6 as [ADDR]:PORT), by getaddrinfo;
  // an IP literal is its own. INVALID_ARGUMENT without a port, NOT_FOUND
  // for a name that does not resolve.
  static absl::StatusOr<std::vector<std::string>> Resolve(const std::string& target);

 private:
  void Refresh();
  void Loop();

  const std::vector<std::string> targets_;
  const PublisherOptions base_;
  const EventPublisher::LoadFn load_;
  const uint64_t refresh_ms_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<std::string, std::set<std::string>> resolved_;              // target -> its addresses
  std::map<std::string, std::unique_ptr<EventPublisher>> publishers_;  // by address
  absl::flat_hash_set<BlockKey, BlockKeyHasher> held_;  // what a new publisher is told
  std::thread refresher_;
};

}  // namespace kvtier

#include "cachestore/eviction_policy.h"

#include <list>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/limits.h"

namespace kvtier::store {
namespace {

// Least recently used: front of the list is the most recent. Eviction walks
// from the least recent, past residents that cannot go (pinned by a lease)
// without moving them: a pin is not a use, so a pinned block keeps its
// place, and a pass does not rotate every pinned block. At most max_scan
// residents (parameter max_scan, limits::kEvictScan by default) are looked
// at per eviction (CacheLib's MMLru bounds its search the same way): past
// them it finds no victim, as when every resident is pinned.
class Lru final : public EvictionPolicy {
 public:
  explicit Lru(size_t max_scan) : max_scan_(max_scan) {}
  std::string name() const override { return "lru"; }
  std::map<std::string, double> params() const override {
    return {{"max_scan", static_cast<double>(max_scan_)}};
  }
  void Insert(uint64_t id) override {
    order_.push_front(id);
    pos_[id] = order_.begin();
  }
  void Touch(uint64_t id) override {
    auto it = pos_.find(id);
    if (it != pos_.end()) order_.splice(order_.begin(), order_, it->second);
  }
  void Erase(uint64_t id) override {
    auto it = pos_.find(id);
    if (it == pos_.end()) return;
    order_.erase(it->second);
    pos_.erase(it);
  }
  std::optional<uint64_t> Evict(const std::function<bool(uint64_t)>& can_evict) override {
    size_t tries = 0;
    for (auto it = order_.rbegin(); it != order_.rend() && tries < max_scan_; ++it, ++tries) {
      if (can_evict(*it)) {
        const uint64_t id = *it;
        order_.erase(std::next(it).base());
        pos_.erase(id);
        return id;
      }
    }
    return std::nullopt;
  }
  size_t size() const override { return pos_.size(); }

 private:
  const size_t max_scan_;
  std::list<uint64_t> order_;
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> pos_;
};

// SIEVE (Zhang et al., NSDI '24): one FIFO, a visited bit, and a hand that
// moves from the oldest entry towards the newest, clearing visited bits and
// evicting the first unvisited entry. New entries go to the head; a hit only
// sets the bit, so there is no list movement on the read path.
class Sieve final : public EvictionPolicy {
 public:
  std::string name() const override { return "sieve"; }
  void Insert(uint64_t id) override {
    queue_.push_front(Node{id, false});
    pos_[id] = queue_.begin();
  }
  void Touch(uint64_t id) override {
    auto it = pos_.find(id);
    if (it != pos_.end()) it->second->visited = true;
  }
  void Erase(uint64_t id) override {
    auto it = pos_.find(id);
    if (it == pos_.end()) return;
    if (hand_valid_ && hand_ == it->second) Advance();
    if (hand_valid_ && hand_ == it->second) hand_valid_ = false;  // it was the only entry
    queue_.erase(it->second);
    pos_.erase(it);
  }
  std::optional<uint64_t> Evict(const std::function<bool(uint64_t)>& can_evict) override {
    if (queue_.empty()) return std::nullopt;
    if (!hand_valid_) {
      hand_ = std::prev(queue_.end());
      hand_valid_ = true;
    }
    // Two full sweeps: the first may only clear visited bits.
    for (size_t steps = 2 * queue_.size() + 1; steps > 0; --steps) {
      if (!hand_->visited && can_evict(hand_->id)) {
        uint64_t id = hand_->id;
        auto victim = hand_;
        Advance();
        if (hand_ == victim) hand_valid_ = false;
        queue_.erase(victim);
        pos_.erase(id);
        return id;
      }
      hand_->visited = false;
      Advance();
    }
    return std::nullopt;
  }
  size_t size() const override { return pos_.size(); }

 private:
  struct Node {
    uint64_t id;
    bool visited;
  };
  // Moves the hand one step towards the head, wrapping to the tail.
  void Advance() {
    if (hand_ == queue_.begin())
      hand_ = std::prev(queue_.end());
    else
      --hand_;
  }
  std::list<Node> queue_;
  std::unordered_map<uint64_t, std::list<Node>::iterator> pos_;
  std::list<Node>::iterator hand_;
  bool hand_valid_ = false;
};

// S3-FIFO (Yang et al., SOSP '23): a small FIFO S (small_fraction of the
// residents) filters one-hit wonders, a main FIFO M with reinsertion holds the
// rest, and a ghost FIFO G of recently evicted ids (as many as M holds) sends
// returning blocks straight to M. Each resident has a 2-bit access count.
//  * Insert: into M if the id is in G, else into S.
//  * Evict from S (when S holds at least small_fraction of residents, or M is
//    empty): the oldest of S moves to M if it was read more than once since
//    insertion (freq > 1), else it is evicted and its id enters G.
//  * Evict from M: the oldest with freq > 0 is reinserted with freq - 1; the
//    first with freq == 0 is evicted.
class S3Fifo final : public EvictionPolicy {
 public:
  explicit S3Fifo(double small_fraction) : small_fraction_(small_fraction) {}
  std::string name() const override { return "s3fifo"; }
  std::map<std::string, double> params() const override {
    return {{"small_fraction", small_fraction_}};
  }
  void Insert(uint64_t id) override {
    bool ghost = ghost_set_.erase(id) > 0;
    if (ghost) {
      // Lazily leave the stale id in ghost_fifo_; it is skipped when trimmed.
      main_.push_front(Node{id, 0});
      pos_[id] = {true, main_.begin()};
    } else {
      small_.push_front(Node{id, 0});
      pos_[id] = {false, small_.begin()};
    }
  }
  void Touch(uint64_t id) override {
    auto it = pos_.find(id);
    if (it != pos_.end() && it->second.it->freq < 3) ++it->second.it->freq;
  }
  void Erase(uint64_t id) override {
    auto it = pos_.find(id);
    if (it == pos_.end()) return;
    (it->second.in_main ? main_ : small_).erase(it->second.it);
    pos_.erase(it);
  }
  std::optional<uint64_t> Evict(const std::function<bool(uint64_t)>& can_evict) override {
    // Each resident can be looked at a bounded number of times (freq <= 3).
    for (size_t steps = 5 * pos_.size() + 2; steps > 0 && !pos_.empty(); --steps) {
      bool from_small = !small_.empty() &&
                        (main_.empty() || static_cast<double>(small_.size()) >=
                                              small_fraction_ * static_cast<double>(pos_.size()));
      if (from_small) {
        Node n = small_.back();
        small_.pop_back();
        if (n.freq > 1 || !can_evict(n.id)) {
          main_.push_front(Node{n.id, 0});
          pos_[n.id] = {true, main_.begin()};
          continue;
        }
        pos_.erase(n.id);
        AddGhost(n.id);
        return n.id;
      }
      Node n = main_.back();
      main_.pop_back();
      if (n.freq > 0 || !can_evict(n.id)) {
        main_.push_front(Node{n.id, static_cast<uint8_t>(n.freq > 0 ? n.freq - 1 : 0)});
        pos_[n.id] = {true, main_.begin()};
        continue;
      }
      pos_.erase(n.id);
      return n.id;
    }
    return std::nullopt;
  }
  size_t size() const override { return pos_.size(); }

 private:
  struct Node {
    uint64_t id;
    uint8_t freq;
  };
  struct Pos {
    bool in_main;
    std::list<Node>::iterator it;
  };
  void AddGhost(uint64_t id) {
    ghost_set_.insert(id);
    ghost_fifo_.push_front(id);
    size_t cap = std::max<size_t>(main_.size(), 1);
    while (ghost_set_.size() > cap && !ghost_fifo_.empty()) {
      ghost_set_.erase(ghost_fifo_.back());
      ghost_fifo_.pop_back();
    }
    // Stale ids (re-inserted since) make the list longer than the set.
    while (ghost_fifo_.size() > 2 * cap + 16) {
      ghost_set_.erase(ghost_fifo_.back());
      ghost_fifo_.pop_back();
    }
  }
  double small_fraction_;
  std::list<Node> small_, main_;
  std::unordered_map<uint64_t, Pos> pos_;
  std::list<uint64_t> ghost_fifo_;
  std::unordered_set<uint64_t> ghost_set_;
};

}  // namespace

const std::vector<std::string>& PolicyNames() {
  static const std::vector<std::string> names = {"lru", "s3fifo", "sieve"};
  return names;
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakePolicy(
    const std::string& name, const std::map<std::string, double>& params) {
  auto reject_params = [&](const char* policy) -> absl::Status {
    if (!params.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy ", policy, " takes no parameters, got \"", params.begin()->first, "\""));
    }
    return absl::OkStatus();
  };
  if (name == "lru") {
    double max_scan = static_cast<double>(limits::kEvictScan);
    for (const auto& [k, v] : params) {
      if (k != "max_scan") {
        return absl::InvalidArgumentError(
            absl::StrCat("policy lru has no parameter \"", k, "\" (it takes max_scan)"));
      }
      if (!(v >= 1 && v <= static_cast<double>(limits::kEvictScanMax)) ||
          v != static_cast<uint64_t>(v)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "lru max_scan ", v, " is not a whole number in 1..", limits::kEvictScanMax));
      }
      max_scan = v;
    }
    return std::unique_ptr<EvictionPolicy>(new Lru(static_cast<size_t>(max_scan)));
  }
  if (name == "sieve") {
    if (auto s = reject_params("sieve"); !s.ok()) return s;
    return std::unique_ptr<EvictionPolicy>(new Sieve());
  }
  if (name == "s3fifo") {
    double small = 0.1;
    for (const auto& [k, v] : params) {
      if (k != "small_fraction") {
        return absl::InvalidArgumentError(
            absl::StrCat("policy s3fifo has no parameter \"", k, "\" (it takes small_fraction)"));
      }
      if (!(v >= 0.01 && v <= 0.5)) {
        return absl::InvalidArgumentError(
            absl::StrCat("s3fifo small_fraction ", v, " is outside 0.01..0.5"));
      }
      small = v;
    }
    return std::unique_ptr<EvictionPolicy>(new S3Fifo(small));
  }
  return absl::InvalidArgumentError(absl::StrCat("eviction policy \"", name, "\" is not one of ",
                                                 absl::StrJoin(PolicyNames(), ", ")));
}

}  // namespace kvtier::store

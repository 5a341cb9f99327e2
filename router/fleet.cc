#include "router/fleet.h"

#include <algorithm>
#include <cmath>

namespace kvtier::router {

void LoadBoard::Ensure(SourceNum num) {
  if (num < load.size()) return;
  load.resize(num + 1, 0);
  id_hash.resize(num + 1, 0);
  occupancy.resize(num + 1, 0);
  lowered.resize(num + 1, 0);
}

size_t Fleet::Join(SourceNum num, LoadBoard& board) {
  nums.push_back(num);
  RebuildOrder(board);
  return nums.size() - 1;
}

SourceNum Fleet::Leave(size_t slot, SourceNum num, LoadBoard& board) {
  const SourceNum moved = nums.back();
  nums[slot] = moved;
  nums.pop_back();
  board.lowered[num] = 0;
  lowered.erase(std::remove(lowered.begin(), lowered.end(), num), lowered.end());
  if (!nums.empty()) RebuildOrder(board);
  return moved;
}

void Fleet::RebuildOrder(LoadBoard& board) {
  order.clear();
  max_load_bound = 0;
  occupancy_sum = 0;  // summed afresh: no drift from rounding
  for (SourceNum n : nums) {
    occupancy_sum += board.occupancy[n];
    order.emplace_back(board.load[n], n);
    if (board.load[n] >= max_load_bound) {
      max_load_bound = board.load[n];
      max_load_owner = n;
    }
  }
  std::sort(order.begin(), order.end());
  for (SourceNum n : lowered) board.lowered[n] = 0;
  lowered.clear();
}

void Fleet::LoadReported(SourceNum num, uint64_t before, LoadBoard& board) {
  const uint64_t now = board.load[num];
  if (now >= max_load_bound) {
    max_load_bound = now;
    max_load_owner = num;
  }
  if (now < before && !board.lowered[num]) {
    board.lowered[num] = 1;
    lowered.push_back(num);
    // Past a sixteenth of the fleet, sorting afresh is cheaper.
    if (lowered.size() > 64 + nums.size() / 16) RebuildOrder(board);
  }
}

void Fleet::PrefillRateChanged(double was, double now) {
  if (was > 0) {
    prefill_sum -= was;
    prefill_count--;
  }
  if (now > 0) {
    prefill_sum += now;
    prefill_count++;
  }
  if (prefill_count == 0) prefill_sum = 0;  // no drift from rounding
}

void Fleet::RaiseBound(SourceNum num, uint64_t load) {
  std::atomic_ref<uint64_t> bound(max_load_bound);
  for (uint64_t b = bound.load(std::memory_order_relaxed); b < load;) {
    if (bound.compare_exchange_weak(b, load, std::memory_order_relaxed)) {
      std::atomic_ref<uint32_t>(max_load_owner).store(num, std::memory_order_relaxed);
      break;
    }
  }
}

}  // namespace kvtier::router

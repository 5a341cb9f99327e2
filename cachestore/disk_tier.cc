#include "cachestore/disk_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "cachestore/record.h"
#include "common/log.h"

namespace kvtier::store {

namespace {

// Big-endian (namespace, hash.hi, hash.lo): a namespace's blocks are contiguous.
std::string EncodeKey(const BlockKey& k) {
  std::string s(24, '\0');
  uint64_t v[3] = {k.ns, k.hash.hi, k.hash.lo};
  for (int i = 0; i < 3; ++i) {
    for (int b = 0; b < 8; ++b) s[i * 8 + b] = static_cast<char>(v[i] >> (56 - 8 * b));
  }
  return s;
}

bool DecodeKey(std::string_view s, BlockKey* k) {
  if (s.size() != 24) return false;
  uint64_t v[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    for (int b = 0; b < 8; ++b) v[i] = (v[i] << 8) | static_cast<uint8_t>(s[i * 8 + b]);
  }
  *k = BlockKey{v[0], BlockHash{v[1], v[2]}};
  return true;
}

std::string EncodeIndexValue(uint64_t record_bytes, uint64_t checksum, uint64_t seq) {
  std::string s(24, '\0');
  std::memcpy(s.data(), &record_bytes, 8);
  std::memcpy(s.data() + 8, &checksum, 8);
  std::memcpy(s.data() + 16, &seq, 8);
  return s;
}

absl::Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", s.ToString()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& o) {
  if (o.admission != "all" && o.admission != "reused") {
    return absl::InvalidArgumentError(
        absl::StrCat("disk admission \"", o.admission, "\" is not one of all, reused"));
  }
  auto policy = MakePolicy(o.policy, o.policy_params);
  if (!policy.ok()) return policy.status();
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create data dir \"", o.dir, "\": ", ec.message()));
  }

  std::unique_ptr<DiskTier> t(new DiskTier());
  t->options_ = o;
  t->policy_ = std::move(*policy);

  rocksdb::DBOptions db_opts;
  db_opts.create_if_missing = true;
  db_opts.create_missing_column_families = true;
  db_opts.max_background_jobs = 2;
  db_opts.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  db_opts.keep_log_file_num = 2;

  rocksdb::ColumnFamilyOptions blocks;
  blocks.compression = rocksdb::kNoCompression;  // KV tensors do not compress
  blocks.enable_blob_files = true;
  blocks.min_blob_size = 4096;
  blocks.blob_file_size = 256ull << 20;
  blocks.blob_compression_type = rocksdb::kNoCompression;
  blocks.enable_blob_garbage_collection = true;
  blocks.blob_garbage_collection_age_cutoff = 0.5;
  blocks.write_buffer_size = 16ull << 20;
  rocksdb::ColumnFamilyOptions small;
  small.write_buffer_size = 8ull << 20;

  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, small},
      {"blocks", blocks},
      {"index", small},
      {"meta", small}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::Status s = rocksdb::DB::Open(db_opts, o.dir, cfs, &handles, &t->db_);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot open RocksDB in \"", o.dir, "\": ", s.ToString()));
  }
  t->default_cf_ = handles[0];
  t->blocks_cf_ = handles[1];
  t->index_cf_ = handles[2];
  t->meta_cf_ = handles[3];

  // Rebuild the in-memory index from the small index column family, oldest
  // write first so the policy starts in write order.
  std::vector<std::pair<uint64_t, std::pair<BlockKey, IndexEntry>>> found;
  std::unique_ptr<rocksdb::Iterator> it(t->db_->NewIterator(rocksdb::ReadOptions(), t->index_cf_));
  uint64_t used = 0;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    BlockKey k;
    if (!DecodeKey(it->key().ToStringView(), &k) || it->value().size() != 24) continue;
    IndexEntry e;
    std::memcpy(&e.record_bytes, it->value().data(), 8);
    std::memcpy(&e.checksum, it->value().data() + 8, 8);
    std::memcpy(&e.seq, it->value().data() + 16, 8);
    found.push_back({e.seq, {k, e}});
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [seq, ke] : found) {
    t->index_[ke.first] = ke.second;
    t->by_seq_[seq] = ke.first;
    t->policy_->Insert(seq);
    t->seq_ = std::max(t->seq_, seq);
    used += ke.second.record_bytes;
  }
  t->counters_.used_bytes = used;
  t->counters_.items = t->index_.size();
  Log("store", "disk tier opened at ", o.dir, ": ", t->index_.size(), " blocks, ", used,
      " bytes recovered");
  t->writer_ = std::thread([p = t.get()] { p->WriterLoop(); });
  return t;
}

DiskTier::~DiskTier() {
  {
    std::lock_guard lk(queue_mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  if (db_ && write_failed_) {
    // Closing would use the failed WAL writer (see write_failed_): leave it
    // to the process exit. Everything acknowledged before the error is in the
    // WAL or SST files and comes back at the next start. Kept reachable from
    // a static, so leak checkers see it as deliberate.
    static std::vector<const void*>* unclosed = new std::vector<const void*>;
    for (const void* p : {static_cast<const void*>(db_), static_cast<const void*>(default_cf_),
                          static_cast<const void*>(blocks_cf_), static_cast<const void*>(index_cf_),
                          static_cast<const void*>(meta_cf_)}) {
      unclosed->push_back(p);
    }
    Log("store", "disk tier: RocksDB left unclosed after its write error");
    return;
  }
  if (db_) {
    for (auto* h : {default_cf_, blocks_cf_, index_cf_, meta_cf_}) {
      if (h) db_->DestroyColumnFamilyHandle(h);
    }
    delete db_;
  }
}

absl::Status DiskTier::WritesStopped() const {
  if (!write_failed_) return absl::OkStatus();
  std::lock_guard lk(degraded_mu_);
  return absl::UnavailableError(degraded_reason_);
}

void DiskTier::WriteFailed(const std::string& what, const std::string& error) {
  write_failed_ = true;
  SetDegraded(absl::StrCat("RocksDB write error while ", what, ": ", error,
                           "; NVMe writes stopped until the store restarts (reads go on)"));
}

bool DiskTier::Contains(const BlockKey& key) const {
  {
    std::lock_guard lk(mu_);
    if (index_.count(key)) return true;
  }
  std::lock_guard lk(queue_mu_);
  return pending_.count(key) > 0;
}

bool DiskTier::Enqueue(const EvictedBlock& b) {
  if (options_.admission == "reused" && b.reads == 0) return false;
  if (write_failed_ || space_paused_) {  // the writer would only drop it: do not copy it
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  {
    std::lock_guard lk(mu_);
    if (index_.count(b.key)) return true;  // already there (promoted earlier)
  }
  std::lock_guard lk(queue_mu_);
  if (pending_.count(b.key)) return true;
  if (stop_ || queue_bytes_ + b.length > options_.queue_bytes) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  auto p = std::make_shared<Pending>(
      Pending{b.key, std::string(reinterpret_cast<const char*>(b.data), b.length), b.checksum});
  queue_bytes_ += b.length;
  pending_[b.key] = p;
  queue_.push_back(std::move(p));
  queue_cv_.notify_one();
  return true;
}

void DiskTier::WriterLoop() {
  for (;;) {
    std::shared_ptr<Pending> p;
    {
      std::unique_lock lk(queue_mu_);
      while (!stop_ && queue_.empty()) {
        if (!space_paused_) {
          queue_cv_.wait(lk);
          continue;
        }
        // Paused for want of space: look again twice a second, so the tier
        // recovers when space returns even if nothing is being demoted.
        if (queue_cv_.wait_for(lk, std::chrono::milliseconds(500)) == std::cv_status::timeout &&
            !write_failed_ && SpaceShortfall(0).empty()) {
          space_paused_ = false;
          SetDegraded("");
        }
      }
      if (queue_.empty()) return;  // stop_ and drained
      p = std::move(queue_.front());
      queue_.pop_front();
      auto it = pending_.find(p->key);
      if (it == pending_.end() || it->second != p) {
        // Evicted by an operator while queued.
        queue_bytes_ -= p->bytes.size();
        if (queue_.empty()) idle_cv_.notify_all();
        continue;
      }
      writing_ = true;
    }
    absl::Status s =
        Write(p->key, reinterpret_cast<const uint8_t*>(p->bytes.data()), p->bytes.size(),
              p->checksum);
    // The block leaves the cache: RAM evicted it and NVMe could not take it.
    if (!s.ok()) dropped_.fetch_add(1, std::memory_order_relaxed);
    bool erased_meanwhile;
    {
      std::lock_guard lk(queue_mu_);
      auto it = pending_.find(p->key);
      erased_meanwhile = it == pending_.end();
      if (!erased_meanwhile && it->second == p) pending_.erase(it);
    }
    // An operator erased the block while it was being written (Evict found
    // it pending, not yet indexed): it must not stay on disk.
    if (s.ok() && erased_meanwhile) EraseKeys({p->key});
    std::lock_guard lk(queue_mu_);
    queue_bytes_ -= p->bytes.size();
    writing_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

void DiskTier::Notify(const std::vector<BlockKey>& removed, const BlockKey* added) {
  std::lock_guard lk(listener_mu_);
  if (!listener_) return;
  for (const auto& k : removed) listener_(k, false);
  if (added) listener_(*added, true);
}

std::string DiskTier::SpaceShortfall(uint64_t bytes) const {
  struct statvfs fs;
  if (statvfs(options_.dir.c_str(), &fs) != 0) return "";
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (free_bytes >= options_.reserve_bytes + bytes) return "";
  return absl::StrCat("disk full: ", free_bytes >> 20, " MiB free on the filesystem of \"",
                      options_.dir, "\", below the reserve of ", options_.reserve_bytes >> 20,
                      " MiB (--disk-reserve-bytes); NVMe writes paused, reads and the RAM tier "
                      "go on");
}

void DiskTier::SetDegraded(const std::string& reason) {
  if (reason.empty() && !degraded_) return;  // every successful write: nothing to clear
  std::lock_guard lk(degraded_mu_);
  if (reason.empty() && degraded_) Log("store", "disk tier recovered");
  if (!reason.empty() && !degraded_) Log("store", "disk tier degraded: ", reason);
  degraded_ = !reason.empty();
  degraded_reason_ = reason;
}

void DiskTier::DropIndexLocked(const BlockKey& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  counters_.used_bytes.fetch_sub(it->second.record_bytes, std::memory_order_relaxed);
  counters_.items.fetch_sub(1, std::memory_order_relaxed);
  by_seq_.erase(it->second.seq);
  index_.erase(it);
}

absl::Status DiskTier::Write(const BlockKey& key, const uint8_t* data, uint64_t length,
                             uint64_t checksum) {
  const uint64_t record_bytes = kRecordHeaderBytes + length;
  if (record_bytes > options_.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "block record of ", record_bytes, " bytes exceeds the disk quota of ", options_.bytes));
  }
  if (std::string why = SpaceShortfall(record_bytes); !why.empty()) {
    space_paused_ = true;
    SetDegraded(why);
    return absl::ResourceExhaustedError(why);
  }
  std::string record = EncodeRecord(data, length, checksum);
  std::vector<BlockKey> victims;
  absl::Status st = WriteAndCollect(key, record, length, checksum, &victims);
  if (st.ok()) Notify(victims, &key);
  return st;
}

absl::Status DiskTier::WriteAndCollect(const BlockKey& key, const std::string& record,
                                   uint64_t length, uint64_t checksum,
                                   std::vector<BlockKey>* evicted) {
  const uint64_t record_bytes = record.size();
  if (auto s = WritesStopped(); !s.ok()) return s;
  std::lock_guard wl(write_mu_);
  rocksdb::WriteBatch batch;
  std::vector<BlockKey>& victims = *evicted;
  uint64_t seq;
  {
    std::lock_guard lk(mu_);
    if (index_.count(key)) return absl::OkStatus();
    uint64_t used = counters_.used_bytes.load();
    uint64_t freed = 0;
    while (used - freed + record_bytes > options_.bytes) {
      auto v = policy_->Evict([](uint64_t) { return true; });
      if (!v) break;
      const BlockKey& vk = by_seq_.at(*v);
      std::string enc = EncodeKey(vk);
      batch.Delete(blocks_cf_, enc);
      batch.Delete(index_cf_, enc);
      freed += index_.at(vk).record_bytes;
      victims.push_back(vk);
    }
    seq = ++seq_;
  }
  std::string enc = EncodeKey(key);
  batch.Put(blocks_cf_, enc, record);
  batch.Put(index_cf_, enc, EncodeIndexValue(record_bytes, checksum, seq));
  // Without mu_: lookups and reads go on while the record reaches the WAL
  // (a reader of a victim then finds it gone and counts a miss).
  rocksdb::Status s = db_->Write(rocksdb::WriteOptions(), &batch);
  std::lock_guard lk(mu_);
  if (!s.ok()) {
    // Nothing was applied: put the victims back in the policy as they were.
    for (const auto& vk : victims) policy_->Insert(index_.at(vk).seq);
    victims.clear();
    WriteFailed("writing a block", s.ToString());
    return FromRocks(s, "writing a block to the disk tier");
  }
  for (const auto& vk : victims) {
    DropIndexLocked(vk);
    counters_.evictions.fetch_add(1, std::memory_order_relaxed);
  }
  index_[key] = IndexEntry{record_bytes, checksum, seq};
  by_seq_[seq] = key;
  policy_->Insert(seq);
  counters_.used_bytes.fetch_add(record_bytes, std::memory_order_relaxed);
  counters_.items.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes_in.fetch_add(length, std::memory_order_relaxed);
  SetDegraded("");
  return absl::OkStatus();
}

absl::StatusOr<std::string> DiskTier::Read(const BlockKey& key, uint64_t* checksum) {
  {
    std::lock_guard lk(queue_mu_);
    if (auto it = pending_.find(key); it != pending_.end()) {
      counters_.hits.fetch_add(1, std::memory_order_relaxed);
      counters_.bytes_out.fetch_add(it->second->bytes.size(), std::memory_order_relaxed);
      *checksum = it->second->checksum;
      return it->second->bytes;
    }
  }
  {
    std::lock_guard lk(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) {
      counters_.misses.fetch_add(1, std::memory_order_relaxed);
      return absl::NotFoundError("block is not on disk");
    }
    policy_->Touch(it->second.seq);
  }
  rocksdb::PinnableSlice value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), blocks_cf_, EncodeKey(key), &value);
  if (s.IsNotFound()) {
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    return absl::NotFoundError("block is not on disk");
  }
  if (!s.ok()) return FromRocks(s, "reading a block from the disk tier");
  auto rec = DecodeRecord(value.ToStringView());
  if (!rec.ok()) {
    checksum_failures_.fetch_add(1, std::memory_order_relaxed);
    Log("store", "disk record of block ", ToHex(key.hash), " rejected: ", rec.status().message());
    EraseKeys({key});
    return rec.status();
  }
  counters_.hits.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes_out.fetch_add(rec->payload.size(), std::memory_order_relaxed);
  *checksum = rec->checksum;
  return std::string(rec->payload);
}

EraseCounts DiskTier::EraseKeys(const std::vector<BlockKey>& keys) {
  std::vector<BlockKey> gone;
  EraseCounts c = EraseAndCollect(keys, &gone);
  Notify(gone, nullptr);
  return c;
}

EraseCounts DiskTier::EraseAndCollect(const std::vector<BlockKey>& keys,
                                      std::vector<BlockKey>* gone) {
  EraseCounts c;
  {
    std::lock_guard lk(queue_mu_);
    for (const auto& k : keys) {
      if (pending_.erase(k)) {
        ++c.erased;
        gone->push_back(k);
      }
    }
  }
  std::lock_guard wl(write_mu_);
  std::lock_guard lk(mu_);
  rocksdb::WriteBatch batch;
  std::vector<BlockKey> present;
  for (const auto& k : keys) {
    auto it = index_.find(k);
    if (it == index_.end()) continue;
    std::string enc = EncodeKey(k);
    batch.Delete(blocks_cf_, enc);
    batch.Delete(index_cf_, enc);
    present.push_back(k);
  }
  if (present.empty()) return c;
  // After a write error the records stay on disk (nothing may be written);
  // they leave the index, so they are not served until the next start.
  rocksdb::Status s = write_failed_ ? rocksdb::Status::OK()
                                    : db_->Write(rocksdb::WriteOptions(), &batch);
  if (!s.ok()) {
    WriteFailed("erasing blocks", s.ToString());
    return c;
  }
  for (const auto& k : present) {
    auto it = index_.find(k);
    if (it == index_.end()) continue;  // the same key twice in `keys`
    policy_->Erase(it->second.seq);
    DropIndexLocked(k);
    ++c.erased;
    gone->push_back(k);
  }
  return c;
}

std::vector<BlockKey> DiskTier::Keys() const {
  std::lock_guard lk(mu_);
  std::vector<BlockKey> out;
  out.reserve(index_.size());
  for (const auto& [k, e] : index_) out.push_back(k);
  return out;
}

EraseCounts DiskTier::Erase(const std::vector<BlockKey>& keys) { return EraseKeys(keys); }

EraseCounts DiskTier::EraseNamespace(uint64_t ns) {
  std::vector<BlockKey> keys;
  {
    std::lock_guard lk(queue_mu_);
    for (const auto& [k, p] : pending_) {
      if (k.ns == ns) keys.push_back(k);
    }
  }
  {
    std::lock_guard lk(mu_);
    for (const auto& [k, e] : index_) {
      if (k.ns == ns) keys.push_back(k);
    }
  }
  return EraseKeys(keys);
}

EraseCounts DiskTier::EraseAll() {
  std::vector<BlockKey> keys;
  {
    std::lock_guard lk(queue_mu_);
    for (const auto& [k, p] : pending_) keys.push_back(k);
  }
  {
    std::lock_guard lk(mu_);
    for (const auto& [k, e] : index_) keys.push_back(k);
  }
  return EraseKeys(keys);
}

absl::Status DiskTier::SetPolicy(const std::string& name,
                                 const std::map<std::string, double>& params) {
  auto p = MakePolicy(name, params);
  if (!p.ok()) return p.status();
  std::lock_guard wl(write_mu_);  // not while a write has victims out of the policy
  std::lock_guard lk(mu_);
  // Seqs are write order: hand the survivors to the new policy in that order.
  std::vector<uint64_t> seqs;
  seqs.reserve(by_seq_.size());
  for (const auto& [seq, k] : by_seq_) seqs.push_back(seq);
  std::sort(seqs.begin(), seqs.end());
  for (uint64_t s : seqs) (*p)->Insert(s);
  policy_ = std::move(*p);
  return absl::OkStatus();
}

std::string DiskTier::policy() const {
  std::lock_guard lk(mu_);
  return policy_->name();
}

std::map<std::string, double> DiskTier::policy_params() const {
  std::lock_guard lk(mu_);
  return policy_->params();
}

absl::Status DiskTier::PutMeta(const std::string& key, const std::string& value) {
  if (auto s = WritesStopped(); !s.ok()) return s;
  rocksdb::WriteOptions wo;
  wo.sync = true;
  rocksdb::Status s = db_->Put(wo, meta_cf_, key, value);
  if (!s.ok()) WriteFailed("writing store metadata", s.ToString());
  return FromRocks(s, "writing store metadata");
}

std::vector<std::pair<std::string, std::string>> DiskTier::ScanMeta(
    const std::string& prefix) const {
  std::vector<std::pair<std::string, std::string>> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta_cf_));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    out.emplace_back(it->key().ToString(), it->value().ToString());
  }
  return out;
}

void DiskTier::WaitIdle() {
  std::unique_lock lk(queue_mu_);
  idle_cv_.wait(lk, [&] { return queue_.empty() && !writing_; });
}

DiskQueueStats DiskTier::QueueStats() const {
  std::lock_guard lk(queue_mu_);
  return DiskQueueStats{queue_.size() + (writing_ ? 1 : 0), queue_bytes_, dropped_.load()};
}

TierSnapshot DiskTier::Snapshot() const {
  TierSnapshot s;
  Fill(counters_, &s);
  s.capacity_bytes = options_.bytes;
  s.policy = policy();
  std::lock_guard lk(degraded_mu_);
  s.degraded = degraded_;
  s.degraded_reason = degraded_reason_;
  return s;
}

}  // namespace kvtier::store

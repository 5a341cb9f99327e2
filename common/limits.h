// The protocol's limits, in one place: servers check them, clients and
// benches size their batches by them, and proto comments quote them
// (proto/kvtier/v1/*.proto).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier::limits {

// Block hashes one store request may name (Lookup, BeginGet, BeginPut,
// VerifyBlocks, ...), and lease ids one ReleaseGets may end.
inline constexpr size_t kMaxBlocksPerRequest = 8192;
// Block hashes one router event or snapshot chunk may carry.
inline constexpr size_t kMaxEventHashes = 65536;
// Tokens per block (a namespace's block_tokens, an engine's page).
inline constexpr uint32_t kMinBlockTokens = 1;
inline constexpr uint32_t kMaxBlockTokens = 65536;
// Most tokens / full blocks one prompt may carry (2 Mi tokens: 16 Ki blocks
// of 128 tokens): a route's, a worker's Submit.
inline constexpr uint64_t kMaxPromptTokens = 2097152;
inline constexpr uint64_t kMaxPromptBlocks = 16384;

// Residents an LRU eviction looks at for one victim, from the least recent
// (pinned ones are passed over in place): past it no victim is found. The
// lru policy's max_scan parameter (--lru-max-scan; kvctl policy set lru
// --param max_scan=N), at most kEvictScanMax.
inline constexpr size_t kEvictScan = 4096;
inline constexpr size_t kEvictScanMax = 1 << 20;

// The socket data plane (kvtier-store; docs/security.md, "Resource
// limits"). Defaults of the store's flags and the tenants file's keys.
// Connections open at once (--data-max-connections).
inline constexpr uint64_t kDataConnections = 4096;
// Connections that have not presented a session yet (--data-max-unhelloed):
// past it, a new connection evicts the oldest of them.
inline constexpr uint64_t kDataUnhelloed = 256;
// How long a new connection has to present its session
// (--data-hello-timeout, milliseconds). Not less: a client's thread sends
// its hello at once, but on a host whose cores an engine keeps busy a
// low-priority thread (the offloader runs at nice 10) can wait seconds for
// a turn; silent floods are bounded by kDataUnhelloed, not by this.
inline constexpr uint64_t kDataHelloMs = 5000;
// How long an authenticated connection may sit without a request
// (--data-idle-timeout, milliseconds).
inline constexpr uint64_t kDataIdleMs = 600000;
// A tenant's data-plane connections open at once (tenants file
// connections=N).
inline constexpr uint64_t kTenantDataConnections = 1024;
// A tenant's data-plane sessions kept (tenants file sessions=N): its
// oldest goes first, never another tenant's. A store without tenants keeps
// kSessions.
inline constexpr uint64_t kTenantSessions = 4096;
// Bytes of data-plane call bodies being read at once: a tenant's (tenants
// file buffered=SIZE), and a store's without tenants (--data-max-buffered).
// A call past it is answered RESOURCE_EXHAUSTED; a body is read as it
// arrives, never allocated at the length a frame declares.
inline constexpr uint64_t kTenantBufferedBytes = 64ull << 20;
// A client's data-plane connections open at once on a store without
// tenants (--data-max-connections-per-client): a client is its verified
// certificate's identity, else its host (never a port or a client_id).
inline constexpr uint64_t kClientDataConnections = 1024;
inline constexpr uint64_t kDataBufferedBytes = 256ull << 20;

// The NVMe tier's group fsync period (--disk-sync=group,
// --disk-sync-interval, milliseconds), and its most.
inline constexpr uint64_t kDiskSyncIntervalMs = 10;
inline constexpr uint64_t kDiskSyncIntervalMaxMs = 10000;
inline constexpr uint64_t kSessions = 65536;

}  // namespace kvtier::limits

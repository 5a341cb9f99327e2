// Blocking-with-deadline TCP helpers for the socket data plane
// (common/data_wire.h): listen, connect, and whole reads and writes of
// non-blocking sockets that poll until a deadline. Every function returns
// UNAVAILABLE for a peer that closed or reset the connection,
// DEADLINE_EXCEEDED past the deadline, CANCELLED when `cancel_fd` (an
// eventfd, -1: none) becomes readable, and the system's error otherwise.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier::net {

using Clock = std::chrono::steady_clock;

// A listening socket on HOST:PORT (port 0 picks one; backlog 1024),
// non-blocking, SO_REUSEADDR. Returns the fd and sets *bound to the address
// actually bound.
absl::StatusOr<int> Listen(const std::string& host_port, std::string* bound);

// A connected, non-blocking TCP socket (TCP_NODELAY) to host:port.
absl::StatusOr<int> Connect(const std::string& host, int port, Clock::time_point deadline);

// Writes every byte of iov[0..n) (the array is consumed as it goes).
absl::Status WriteAll(int fd, struct iovec* iov, int n, Clock::time_point deadline,
                      int cancel_fd = -1);
absl::Status WriteAll(int fd, const void* data, size_t length, Clock::time_point deadline,
                      int cancel_fd = -1);
// Reads exactly `length` bytes.
absl::Status ReadAll(int fd, void* data, size_t length, Clock::time_point deadline,
                     int cancel_fd = -1);
// Reads and drops `length` bytes.
absl::Status Discard(int fd, uint64_t length, Clock::time_point deadline, int cancel_fd = -1);

// Waits until fd is readable (true) or the deadline / cancel_fd (false).
bool WaitReadable(int fd, Clock::time_point deadline, int cancel_fd = -1);

}  // namespace kvtier::net

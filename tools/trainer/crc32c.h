// CRC-32C (Castagnoli), the checksum of TFRecord framing (tools/trainer/tensorboard.h): the reflected
// polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF, as RFC 3720 (iSCSI) defines it.
#pragma once

#include <cstdint>
#include <string_view>

namespace shardswap {

/// CRC-32C of `data`; crc32c("123456789") == 0xE3069283.
std::uint32_t crc32c(std::string_view data);

/// crc32c(data) rotated right by 15 bits plus 0xa282ead8: TFRecord stores this "masked" form so
/// that the CRC of bytes that themselves hold CRCs is not degenerate.
std::uint32_t masked_crc32c(std::string_view data);

}  // namespace shardswap

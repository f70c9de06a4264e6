//! The protobuf codec of both gRPC services: tonic's prost codec, except that a message that
//! cannot be decoded is INVALID_ARGUMENT (the caller sent bad bytes) instead of INTERNAL, which
//! would blame the server.

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// See the module docs. Named by `build.rs` (`codec_path`).
#[derive(Debug)]
pub struct ApiCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for ApiCodec<T, U> {
    fn default() -> Self {
        ApiCodec(ProstCodec::default())
    }
}

impl<T, U> Codec for ApiCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ApiDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ApiDecoder(self.0.decoder())
    }
}

/// The prost decoder with decode failures turned into INVALID_ARGUMENT.
#[derive(Debug)]
pub struct ApiDecoder<U>(ProstDecoder<U>);

impl<U> Decoder for ApiDecoder<U>
where
    U: prost::Message + Default + Send + 'static,
{
    type Item = U;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(src).map_err(|e| {
            if e.code() == tonic::Code::Internal {
                Status::invalid_argument(format!("message cannot be decoded: {}", e.message()))
            } else {
                e
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

//! The request stream: `sessions × turns` requests of one prompt length, round-robin over the
//! sessions, all derived from `--seed` (the same seed gives the same tokens and arrivals).
//!
//! Prompt of session s, turn t (lengths in whole blocks; H = hit rate × prompt, S = the system
//! prompt, at most H):
//!
//! ```text
//! [ system prompt s mod P : S ][ session s context : H − S ][ fresh tokens of (s, t) : prompt − H ]
//! ```
//!
//! Turn 1 finds at most the system prompt cached (stored by an earlier session sharing it; the
//! first session of each prompt finds nothing); later turns find H tokens (turn 1 stored its
//! whole prompt, whose first H tokens they repeat) — if the earlier store has committed by then:
//! a write still queued is not visible, as in a real engine. The live lookup decides; the
//! prediction uses the prefix each request actually found.

use crate::usage;

use super::Arrivals;

/// The shape every hit rate of a run shares.
#[derive(Debug, Clone)]
pub struct StreamShape {
    pub prompt_tokens: u64,
    pub block_tokens: u64,
    pub sessions: u32,
    pub turns: u32,
    pub system_prompts: u32,
    /// None: a quarter of the prompt, capped by the cached part.
    pub system_prompt_tokens: Option<u64>,
    pub decode_steps: u32,
    pub arrivals: Arrivals,
    /// Requests per second of the modelled system (Poisson only).
    pub arrival_rate: f64,
}

impl StreamShape {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        prompt_tokens: u64,
        block_tokens: u64,
        sessions: u32,
        turns: u32,
        system_prompts: u32,
        system_prompt_tokens: Option<u64>,
        decode_steps: u32,
        arrivals: Arrivals,
        arrival_rate: f64,
    ) -> anyhow::Result<Self> {
        if prompt_tokens < 2 * block_tokens || !prompt_tokens.is_multiple_of(block_tokens) {
            return usage(format!(
                "--prompt-tokens={prompt_tokens}: serve needs a whole number of blocks, at least two (accepted: multiples of {block_tokens} from {})",
                2 * block_tokens
            ));
        }
        if prompt_tokens > 65_536 {
            return usage(format!("--prompt-tokens={prompt_tokens}: serve accepts up to 65536 tokens (the pool is held in memory)"));
        }
        if u64::from(sessions) * u64::from(turns) > 4096 {
            return usage(format!("--sessions={sessions} × --turns={turns}: at most 4096 requests"));
        }
        if let Some(tokens) = system_prompt_tokens.filter(|tokens| *tokens > prompt_tokens) {
            return usage(format!("--system-prompt-tokens={tokens} is longer than --prompt-tokens={prompt_tokens}"));
        }
        Ok(Self {
            prompt_tokens,
            block_tokens,
            sessions,
            turns,
            system_prompts,
            system_prompt_tokens,
            decode_steps,
            arrivals,
            arrival_rate,
        })
    }

    pub fn requests(&self) -> usize {
        self.sessions as usize * self.turns as usize
    }

    pub fn blocks(&self) -> u64 {
        self.prompt_tokens / self.block_tokens
    }

    /// Tokens a request past its session's first turn finds cached: H, whole blocks.
    pub fn cached_tokens(&self, hit_rate: f64) -> u64 {
        ((self.blocks() as f64 * hit_rate).round() as u64).min(self.blocks() - 1) * self.block_tokens
    }

    pub fn system_tokens(&self, hit_rate: f64) -> u64 {
        let wanted = self.system_prompt_tokens.unwrap_or(self.prompt_tokens / 4) / self.block_tokens * self.block_tokens;
        wanted.min(self.cached_tokens(hit_rate))
    }
}

/// One request of the stream.
#[derive(Debug, Clone)]
pub struct Request {
    pub tokens: Vec<u32>,
    /// Arrival, in µs of the modelled system (0 for every request of a closed loop).
    pub arrival_us: f64,
}

/// A deterministic token sequence for `(kind, a, b)` under `seed` (an LCG; only determinism and
/// spread matter). Kinds keep system prompts, session contexts and fresh tokens apart.
fn tokens(seed: u64, kind: u64, a: u64, b: u64, count: u64, out: &mut Vec<u32>) {
    let mut state =
        seed ^ kind.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ a.wrapping_mul(0xc2b2_ae3d_27d4_eb4f) ^ b.wrapping_mul(0x1656_67b1_9e37_79f9);
    for _ in 0..count {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        out.push((state >> 33) as u32);
    }
}

/// A uniform number in (0, 1] from a SplitMix64 step (for the exponential gaps).
fn uniform(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

/// The stream at `hit_rate`.
pub fn build(shape: &StreamShape, hit_rate: f64, seed: u64) -> Vec<Request> {
    let cached = shape.cached_tokens(hit_rate);
    let system = shape.system_tokens(hit_rate);
    let mut requests = Vec::with_capacity(shape.requests());
    let mut clock = seed ^ 0x5e57_e5e5;
    let mut arrival_us = 0.0;
    for turn in 1..=shape.turns {
        for session in 0..shape.sessions {
            let mut prompt = Vec::with_capacity(shape.prompt_tokens as usize);
            tokens(seed, 1, u64::from(session % shape.system_prompts), 0, system, &mut prompt);
            tokens(seed, 2, u64::from(session), 0, cached - system, &mut prompt);
            tokens(seed, 3, u64::from(session), u64::from(turn), shape.prompt_tokens - cached, &mut prompt);
            if shape.arrivals == Arrivals::Poisson && !requests.is_empty() {
                arrival_us += -uniform(&mut clock).ln() / shape.arrival_rate * 1e6;
            }
            requests.push(Request { tokens: prompt, arrival_us });
        }
    }
    requests
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(arrivals: Arrivals) -> StreamShape {
        StreamShape::new(256, 16, 3, 2, 2, None, 1, arrivals, 100.0).unwrap()
    }

    #[test]
    fn the_stream_is_deterministic_and_shares_what_it_says() {
        // Goal: the same seed gives the same stream; sessions sharing a system prompt share its
        // tokens; a later turn repeats its session's cached part and nothing else.
        let shape = shape(Arrivals::Poisson);
        let (a, b) = (build(&shape, 0.5, 7), build(&shape, 0.5, 7));
        assert!(a.iter().zip(&b).all(|(x, y)| x.tokens == y.tokens && x.arrival_us == y.arrival_us));
        assert_ne!(build(&shape, 0.5, 8)[0].tokens, a[0].tokens);
        let (system, cached) = (shape.system_tokens(0.5) as usize, shape.cached_tokens(0.5) as usize);
        assert_eq!((system, cached), (64, 128));
        // Sessions 0 and 2 share system prompt 0; session 1 has prompt 1.
        assert_eq!(a[0].tokens[..system], a[2].tokens[..system]);
        assert_ne!(a[0].tokens[..system], a[1].tokens[..system]);
        // Turn 2 of session 0 (request 3: round-robin over 3 sessions) repeats turn 1's first H tokens, then differs.
        assert_eq!(a[3].tokens[..cached], a[0].tokens[..cached]);
        assert_ne!(a[3].tokens[cached..cached + 16], a[0].tokens[cached..cached + 16]);
        assert!(a.windows(2).all(|pair| pair[1].arrival_us > pair[0].arrival_us));
        assert!(build(&self::shape(Arrivals::Closed), 0.5, 7).iter().all(|request| request.arrival_us == 0.0));
    }
}

"""NVIDIA Apex's own amp unit tests, run against mixprec's Apex-compatible API.

The test files here are adapted from NVIDIA/apex, tests/L0/run_amp/ at commit e13873d (the
parent of cb65b8e, "remove old features: amp, ddp, and rnn (#1896)"), the last commit with amp.
Each file keeps Apex's license (below) and says what changed: the imports (``amp`` is
`tests.peers.apex.amp`, mixprec's API) and the device (CPU, fp16, CUDA op table). Files and
tests left out, and tests changed beyond that, are listed with the reason in docs/migration.md,
"Running Apex's amp tests".
"""
# Adapted from NVIDIA/apex, tests/L0/run_amp/*.py at commit e13873d (the parent of cb65b8e,
# "remove old features: amp, ddp, and rnn (#1896)"). Apex's license (BSD 3-Clause) follows.
#
# All rights reserved.
#
# Redistribution and use in source and binary forms, with or without modification, are
# permitted provided that the following conditions are met:
#
# 1. Redistributions of source code must retain the above copyright notice, this list of
#    conditions and the following disclaimer.
#
# 2. Redistributions in binary form must reproduce the above copyright notice, this list of
#    conditions and the following disclaimer in the documentation and/or other materials
#    provided with the distribution.
#
# 3. Neither the name of the copyright holder nor the names of its contributors may be used
#    to endorse or promote products derived from this software without specific prior written
#    permission.
#
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS
# OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF
# MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE
# COPYRIGHT HOLDER OR CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL,
# EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF SUBSTITUTE
# GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS INTERRUPTION) HOWEVER CAUSED
# AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING
# NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED
# OF THE POSSIBILITY OF SUCH DAMAGE.
